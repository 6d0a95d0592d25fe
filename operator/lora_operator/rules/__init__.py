"""The operator's decisions: pure functions from what it knows to what should happen.

What a pod should hold and the calls that close the gap (`planning`, `podstate`), where each
adapter goes (`placement`, `autoscale`), how a new revision rolls out (`rollout`, `canary`), what
an adapter's status says and when it is written (`status`, `statuswrite`, `events`), what a
restarted operator resumes from (`resume`), what to collect (`gc`), what a composition is built
from (`composition`), what a source may use and reach (`consent`), which pods are the release's
(`trust`); the objects they read (`model`) and the staging errors they raise (`errors`).

Must not: do I/O, read a clock, or import the store, the controller or the edges (the import
contracts in .importlinter hold this): the controller feeds these modules and acts on what they
return, and their tests need no network, cluster or volume.
"""
