"""LoRA adapters: the request type users name them with (vLLM's ``LoRARequest``).

The layers that apply adapters live in ``kvserve.model_executor.lora`` (torch, worker
side); this package stays a leaf so the engine and scheduler can carry the request.
"""
