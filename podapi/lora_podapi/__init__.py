"""The inference pod's HTTP API as JSON, defined once: each payload a frozen value with a
`render` function (the server answers with it) and a `parse` function (the operator and the
router read pods with it), and a version the payload carries (`api_version`).

- `models`: `GET /v1/models`, the base model's card and one card per adapter (what the operator
  reconciles by; the router lists their union).
- `adapters`: `GET /v1/adapters`, every adapter's tier and usage, and its residency view
  (`?view=residency`, what the router polls).
- `headers`: the headers of a generation's answer (the pod's queue, what made the images).

A parser reads every version a pod of a rolling upgrade may send: older servers', vLLM's, and
newer ones' as far as their fields are known. Pure: no I/O, no HTTP library. Imports
`lora_volume` only (a revision's path in an older card); both images install it.
"""
