"""`kvserve cache-controller`: which instance holds which prefix in which KV tier, and
the operator's pin / unpin / clear / move over them."""
