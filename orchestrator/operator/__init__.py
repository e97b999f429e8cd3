"""The Kubernetes operator: one `DisaggregatedService` resource → a running pdorch service.

Pure modules (no kopf, no I/O; import-linter keeps them so):

    spec        the resource's spec, parsed and defaulted into frozen dataclasses
    naming      deterministic names and labels of every child object
    render      render(identity, spec) → the child objects, in apply order
    workloads   the Deployments / StatefulSet pod templates render uses
    tls         cert-manager Certificates per component identity; each pod's own key mount
    drift       is a live object still what we rendered? what may a patch touch?
    health      children's readiness → status: conditions, ready counts, mode

I/O around them:

    kube        a small async Kubernetes REST client (the only HTTP in the package)
    reconcile   apply rendered objects idempotently, observe readiness, tear down
    handlers    kopf handlers: create/update/resume/timer → reconcile; delete → tear down
    runner      builds the kopf registry and settings and runs the operator
"""
