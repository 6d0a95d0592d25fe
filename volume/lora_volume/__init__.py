"""The shared adapter volume's contract, for the operator that writes it and the servers that
read it: the layout (`layout`), the checks an adapter file must pass (`files`), which pods an
adapter is for (`targeting`) and their errors (`errors`).

Imports nothing of the other packages and no torch, aiohttp or kopf: both images install it.
"""
