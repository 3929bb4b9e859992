"""Disaggregated prefill: the proxy in front of prefill and decode instances, and a launcher."""
