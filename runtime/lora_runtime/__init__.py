"""What every process of the product needs to run in a pod, whichever image it is in: the
Kubernetes API client and its login (`kube`, `login`), the retry delays (`backoff`), sizes with
units (`sizes`), bearer tokens from mounted Secrets (`tokenfiles`) and the Prometheus plumbing
(`metrics`). The operator, the router and the inference server each use what they need of it.

Imports none of the other packages and no torch or kopf: both images install it, and the router
(in the operator image) runs without kopf. Owns no decision of the product's.
"""
