"""`pdorch chaos`: chaos-testing failover as a tool users run.

scenario.py   PURE: scenario files (YAML) → validated dataclasses; seeded fault plans
history.py    PURE: the record of every client operation and fault (after Jepsen)
checker.py    PURE: history + fault-free reference → lost, duplicates, gaps, mismatches,
              recovery times, error codes
proxy.py      a loopback TCP fault proxy (delay, bandwidth, dropped connections, corruption)
faults.py     executes planned faults on a local cluster (signals, restarts, proxies)
workload.py   the clients: streams with reconnect-and-resume, every step recorded
runner.py     one command's runs: cluster up, reference, faulted runs, restore, report
timeline.py   the timeline picture (PNG)
"""
