"""The operator benchmark (bench/bench_operator.py, whose docstring says what it measures and
how): the operator's requests as the API server counts them (`apiserver`), the inference pods
and the bare calls that are the limits (`pods`), one configuration's figures (`rows`), staging
speed without a cluster (`staging`), the tables (`report`) and the command line (`cli`)."""
