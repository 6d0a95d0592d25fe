"""The content-addressed store on the shared adapter volume: a source fetched (the one guarded
HTTP client, the Hub, S3), verified and published as an immutable revision, each namespace held
to its quota, and the volume collected and checked.

`staging.Store` is the store's face (what the controller's `seams.Volume` names) and holds the
order of things and the locks; beneath it, publishing a verified file or a composition as a
revision (`publishing`), the atomic file operations (`volumefiles`), the quota ledger and a
download's reservation (`quota`), fetching (`fetchers`, `downloads`, `s3fetch`, `egress`,
`sinks`, `sources`), the limits (`limits`) and the start-up check (`volumecheck`).

Must not: import the controller or the edges, nor talk to the API server or to pods (no kopf,
no aiohttp): what it decides is the rules' (`gc`, `consent`), what it is asked to stage comes in
through its arguments.
"""
