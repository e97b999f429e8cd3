"""The store's server-side scripts: each request-state change is one of these Lua scripts,
run atomically by Redis (`orchestrator.store.redis_store` registers them, each after
`orchestrator.store.lua.PRELUDE`, which defines ``TERMINAL``, ``EDGES``, ``INITIAL`` and
``now_ms()``). Above each: its keys, its arguments and its reply.

Every script touches only the keys it is given, and those of one request share a hash tag
(`orchestrator.store.keys`): each call stays within one Redis Cluster slot.
"""

from __future__ import annotations

# KEYS[1] record, KEYS[2] owner lease, KEYS[3] (optional: one server only) the live index.
# ARGV[1] ttl seconds, ARGV[2] owner, ARGV[3] lease ms, ARGV[4] "1" when the tenant's limit
# counted it (`ACQUIRE`), ARGV[5..] field/value pairs.
# With KEYS[3], the record key is added to the live index (stamped now) with the creation,
# in the same step; a cluster (other slots) indexes it with `ACQUIRE` beside this call.
# Returns {1} when created, {0, body_hash, state} when the id exists already (the index is
# then left as it was).
CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  local got = redis.call('HMGET', KEYS[1], 'body_hash', 'state')
  return {0, got[1], got[2]}
end
local now = now_ms()
if KEYS[3] then redis.call('ZADD', KEYS[3], now, KEYS[1]) end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('HSET', KEYS[1], 'updated_at', now, 'counted', ARGV[4])
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
redis.call('SET', KEYS[2], ARGV[2], 'PX', tonumber(ARGV[3]))
return {1}
"""

# KEYS[1] an index (`Keys.active`, `Keys.tenant_inflight`: record key -> ms it was added).
# ARGV[1] record key, ARGV[2] the tenant's limit (0: none), ARGV[3] the index's ttl in
# seconds (0: none).
# Adds the record key, stamped now; with a limit, only while fewer than that many are in it
# (one already in it is not counted twice: a resubmission). Returns {1, added 0|1}, or
# {-1, count} at the limit.
ACQUIRE = """
if redis.call('ZSCORE', KEYS[1], ARGV[1]) and tonumber(ARGV[2]) > 0 then return {1, 0} end
local n = redis.call('ZCARD', KEYS[1])
if tonumber(ARGV[2]) > 0 and n >= tonumber(ARGV[2]) then return {-1, n} end
redis.call('ZADD', KEYS[1], now_ms(), ARGV[1])
if tonumber(ARGV[3]) > 0 then redis.call('EXPIRE', KEYS[1], tonumber(ARGV[3])) end
return {1, 1}
"""

# KEYS[1] an index. ARGV[1] record key, ARGV[2] grace ms. Removes the key if it was added
# at least that long ago (0: whenever): a record found missing may be one being created
# right now (indexed first, `RedisStore.create`), so it is dropped only after the grace.
# Returns 1 when removed.
UNINDEX = """
local since = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not since or tonumber(since) > tonumber(now_ms()) - tonumber(ARGV[2]) then return 0 end
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

# KEYS[2i-1] lease, KEYS[2i] record of request i. ARGV[1] owner, ARGV[2] lease ms,
# ARGV[3] "1" to re-take lapsed leases, ARGV[3+i] the epoch the owner drives request i at.
# `REFRESH` for many requests at once, plus: a lease that lapsed (a stalled event loop
# refreshed it late) and that nobody took over is taken again — only while the record still
# names this owner at this epoch and has not ended, so a takeover or hand-off always wins.
# Returns one 1 (held) or 0 (lost) per request.
REFRESH_MANY = """
local out = {}
local n = #KEYS / 2
for i = 1, n do
  local lease, rec = KEYS[2 * i - 1], KEYS[2 * i]
  local holder = redis.call('GET', lease)
  if holder == ARGV[1] then
    redis.call('PEXPIRE', lease, tonumber(ARGV[2]))
    out[i] = 1
  elseif not holder and ARGV[3] == '1' then
    local cur = redis.call('HMGET', rec, 'owner', 'epoch', 'state')
    if cur[1] == ARGV[1] and cur[2] == ARGV[3 + i] and not TERMINAL[cur[3]] then
      redis.call('SET', lease, ARGV[1], 'PX', tonumber(ARGV[2]))
      out[i] = 1
    else
      out[i] = 0
    end
  else
    out[i] = 0
  end
end
return out
"""

# KEYS[1] lease. ARGV[1] owner. Drops the lease only for its holder (a hand-off).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] lease. ARGV[1] owner, ARGV[2] lease ms. Extends the lease only for its holder.
REFRESH = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[2]))
  return 1
end
return 0
"""

# KEYS[1] record, KEYS[2] lease. ARGV[1] new owner, ARGV[2] lease ms.
# Takes over a live request whose owner's lease expired: the take_over edge (epoch + 1,
# back to queued). Returns {1, new_epoch}; {0} lease still held; {-1} missing; {-3, state,
# tenant counted} already ended (the caller drops it from the indexes).
TAKEOVER = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'tenant', 'counted')
if not cur[1] then return {-1} end
local edge = EDGES.take_over
if not edge.src[cur[1]] then return {-3, cur[1], cur[3] or '', cur[4] or ''} end
if redis.call('EXISTS', KEYS[2]) == 1 then return {0} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]))
local epoch = tonumber(cur[2]) + edge.bump
redis.call('HSET', KEYS[1], 'state', edge.dst, 'epoch', tostring(epoch), 'owner', ARGV[1],
  'updated_at', now_ms())
return {1, epoch}
"""

# KEYS[1] record, KEYS[2] owner lease (deleted on a terminal state).
# ARGV[1] expected epoch, ARGV[2] the edge's name (`EDGES`), ARGV[3] the call's token,
# ARGV[4..] field/value pairs.
# Returns {1, state, epoch, tenant, counted} on success (the caller drops an ended request
# from the indexes); {-1} missing; {-2, state, epoch} epoch mismatch; {-3, state, epoch}
# state not one of the edge's sources.
# The token (field ``op``) makes a retry exactly-once: a call whose write landed but whose
# reply was lost is tried again (`orchestrator.store.outage`) and answered as done — only
# while the record is still where that write left it (its token, target state and epoch);
# anything that moved it since (a takeover, an expiry) answers as for any other caller.
TRANSITION = """
local edge = EDGES[ARGV[2]]
if not edge then return redis.error_reply('unknown edge ' .. ARGV[2]) end
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'op', 'tenant', 'counted')
if not cur[1] then return {-1} end
local epoch = tostring(tonumber(ARGV[1]) + edge.bump)
if cur[3] == ARGV[3] and cur[1] == edge.dst and cur[2] == epoch then
  return {1, cur[1], cur[2], cur[4] or '', cur[5] or ''}
end
if cur[2] ~= ARGV[1] then return {-2, cur[1], cur[2]} end
if not edge.src[cur[1]] then return {-3, cur[1], cur[2]} end
redis.call('HSET', KEYS[1], 'state', edge.dst, 'epoch', epoch, 'updated_at', now_ms(),
  'op', ARGV[3])
if #ARGV > 3 then redis.call('HSET', KEYS[1], unpack(ARGV, 4)) end
if TERMINAL[edge.dst] then redis.call('DEL', KEYS[2]) end
return {1, edge.dst, epoch, cur[4] or '', cur[5] or ''}
"""

# KEYS[1] record, KEYS[2] owner lease, KEYS[3] live index, KEYS[4] the tenant's live
# count, KEYS[5] the tenant's cost totals, KEYS[6] the tenants index — all on one server
# (a cluster ends a request slot by slot instead: `RedisStore.end`).
# ARGV[1] expected epoch, ARGV[2] a terminal edge's name, ARGV[3] the call's token (as
# `TRANSITION`'s), ARGV[4] tenant, ARGV[5] float cost fields n, ARGV[6] integer cost fields
# m, then n + m name/increment pairs (floats first), then the record's field/value pairs.
# A request's whole end in one step: `TRANSITION`'s checks and write, the lease dropped,
# out of the live index (and the tenant's count, if counted), its cost added to the
# tenant's totals; a retry whose first try landed (its token) adds nothing again.
# Returns {1, the record's HGETALL}; {-1} missing; {-2, state, epoch} epoch mismatch;
# {-3, state, epoch} state not a source; {-4} the record's tenant is not ARGV[4] (nothing
# written: the caller ends it the general way).
END = """
local edge = EDGES[ARGV[2]]
if not edge or not TERMINAL[edge.dst] then
  return redis.error_reply('not an ending edge ' .. ARGV[2])
end
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'op', 'tenant', 'counted')
if not cur[1] then return {-1} end
local epoch = tostring(tonumber(ARGV[1]) + edge.bump)
if cur[3] == ARGV[3] and cur[1] == edge.dst and cur[2] == epoch then
  return {1, redis.call('HGETALL', KEYS[1])}
end
if cur[2] ~= ARGV[1] then return {-2, cur[1], cur[2]} end
if not edge.src[cur[1]] then return {-3, cur[1], cur[2]} end
if (cur[4] or '') ~= ARGV[4] then return {-4} end
local nf, ni = tonumber(ARGV[5]), tonumber(ARGV[6])
local first = 7 + 2 * (nf + ni)
redis.call('HSET', KEYS[1], 'state', edge.dst, 'epoch', epoch, 'updated_at', now_ms(),
  'op', ARGV[3])
if #ARGV >= first then redis.call('HSET', KEYS[1], unpack(ARGV, first)) end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], KEYS[1])
if cur[5] == '1' then redis.call('ZREM', KEYS[4], KEYS[1]) end
redis.call('SADD', KEYS[6], ARGV[4])
redis.call('HINCRBY', KEYS[5], 'requests', 1)
for i = 0, nf + ni - 1 do
  local cmd = 'HINCRBY'
  if i < nf then cmd = 'HINCRBYFLOAT' end
  redis.call(cmd, KEYS[5], ARGV[7 + 2 * i], ARGV[8 + 2 * i])
end
return {1, redis.call('HGETALL', KEYS[1])}
"""

# KEYS: record, journal — one pair per chunk (a request's pair repeats for each of its
# chunks). ARGV[1] ttl; then five per chunk: epoch, first index, token count, entry JSON, and
# an edge's name or '' (the chunk also takes that edge: `append_many`'s ``edges``).
# Each chunk, in order, is appended only at its request's current end (no gap, no
# duplicate) and only for the current epoch of a live request — so a request's later chunk
# in the same call chains after its earlier one. A chunk with an edge moves its request to
# the edge's target first (nothing to do when it is there already: a retried write).
# Returns two values per chunk: 1, new_count; -1, 0 missing; -2, epoch stale; -3, state
# ended; -4, count gap; -5, state not one of the edge's sources.
APPEND = """
local ttl = tonumber(ARGV[1])
local out = {}
local now = nil
for i = 0, #KEYS / 2 - 1 do
  local rec, jour, a = KEYS[2 * i + 1], KEYS[2 * i + 2], 2 + 5 * i
  local cur = redis.call('HMGET', rec, 'epoch', 'output_tokens', 'state')
  local edge = nil
  if ARGV[a + 4] ~= '' then edge = EDGES[ARGV[a + 4]] end
  local code, val = 1, 0
  if not cur[1] then code = -1
  elseif cur[1] ~= ARGV[a] then code, val = -2, cur[1]
  elseif TERMINAL[cur[3]] then code, val = -3, cur[3]
  elseif cur[2] ~= ARGV[a + 1] then code, val = -4, cur[2]
  elseif edge and cur[3] ~= edge.dst and not edge.src[cur[3]] then code, val = -5, cur[3]
  else
    now = now or now_ms()
    if edge and cur[3] ~= edge.dst then redis.call('HSET', rec, 'state', edge.dst) end
    redis.call('RPUSH', jour, ARGV[a + 3])
    redis.call('EXPIRE', jour, ttl)
    val = redis.call('HINCRBY', rec, 'output_tokens', tonumber(ARGV[a + 2]))
    redis.call('HSET', rec, 'updated_at', now)
  end
  out[#out + 1] = code
  out[#out + 1] = val
end
return out
"""

# KEYS[1] record, KEYS[2] lease. ARGV[1] state, ARGV[2] epoch, ARGV[3] updated_at,
# ARGV[4] error. Fails a request that made no progress since the reaper read it (same
# state, epoch and progress time): a request that moved meanwhile is left be.
# Returns {1, tenant, counted} when failed (the caller drops it from the indexes), {0}
# otherwise.
EXPIRE = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'epoch', 'updated_at', 'tenant', 'counted')
if not cur[1] or cur[1] ~= ARGV[1] or cur[2] ~= ARGV[2] or cur[3] ~= ARGV[3] then return {0} end
if not EDGES.expire.src[cur[1]] then return {0} end
redis.call('HSET', KEYS[1], 'state', EDGES.expire.dst, 'finish_reason', 'error', 'error', ARGV[4])
redis.call('DEL', KEYS[2])
return {1, cur[4] or '', cur[5] or ''}
"""

# KEYS[1] record. ARGV[1] the terminal state it must be in, ARGV[2] the cost's JSON,
# ARGV[3..] field/value pairs. Prices a request whose end another caller recorded
# (`Store.settle`): only a record ended so, without a cost yet, takes it. Returns 1 when it
# did; 0 when the record is missing, in another state, or priced.
SETTLE = """
local cur = redis.call('HMGET', KEYS[1], 'state', 'cost')
if not cur[1] or not TERMINAL[cur[1]] or cur[1] ~= ARGV[1] then return 0 end
if cur[2] and cur[2] ~= '' and cur[2] ~= '{}' then return 0 end  -- '{}': created so
redis.call('HSET', KEYS[1], 'cost', ARGV[2])
if #ARGV > 2 then redis.call('HSET', KEYS[1], unpack(ARGV, 3)) end
return 1
"""

# KEYS[1] record. ARGV field/value pairs. Only an existing record is updated (a bare HSET
# would create a partial record without a TTL). Returns 1, or 0 when missing.
SET = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""
