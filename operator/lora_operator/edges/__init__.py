"""Where the operator meets the outside world: kopf's events coming in (`handlers`, which call
the controller), and going out the API server (`kube`), the inference pods (`podclient`, with the
credentials of `podtokens`), the other replicas (`peering`), Prometheus (`metrics`) and the
command line (`config`).

The clients (all but `handlers`) import nothing of the controller: the controller calls them,
and kopf's handlers call the controller, so imports go one way (the import contracts in
.importlinter hold both).
"""
