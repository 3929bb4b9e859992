"""LLM: offline batched generation and chat, the way vLLM's LLM class is used."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from kvserve.args.engine_args import EngineArgs
from kvserve.beam_search import BeamSearchOutput
from kvserve.config import DEFAULT_MODEL
from kvserve.engine.chat_media import extract_chat_images, has_image_parts, media_policy
from kvserve.engine.input_processor import apply_chat_template
from kvserve.engine.llm_engine import LLMEngine
from kvserve.entrypoints.llm_beam_search import run_beam_search
from kvserve.inputs import UNPAIRED_SURROGATE, PromptType, unpaired_surrogate_path
from kvserve.lora.request import LoRARequest
from kvserve.metrics.reader import Metric
from kvserve.outputs import (
    AnyRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

ChatMessages = list[dict[str, Any]]


class LLM:
    """An offline engine. Keyword arguments are EngineArgs fields (vLLM's names);
    `multiprocess_mode=True` runs the engine core in a background process."""

    def __init__(
        self,
        model: str | None = DEFAULT_MODEL,
        *,
        multiprocess_mode: bool = False,
        disable_log_stats: bool = True,
        **kwargs: Any,
    ) -> None:
        # vLLM's LLM keeps engine statistics off unless asked for.
        kwargs.setdefault("disable_log_stats", True)
        engine_args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(
            engine_args, multiprocess_mode=multiprocess_mode, log_stats=not disable_log_stats
        )
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation config applied (vLLM's behaviour;
        none with generation_config="vllm"). Used when generate() gets no params."""
        return SamplingParams(**self.llm_engine.config.model_config.get_diff_sampling_param())

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        *,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: the best ``params.beam_width`` beams of each prompt."""
        return run_beam_search(self, prompts, params, use_tqdm, concurrency_limit)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Calls ``method`` (a Worker method name, or a callable taking the worker first)
        on every worker; the results in rank order. Needs the in-process engine core."""
        return self.llm_engine.collective_rpc(method, timeout, args, kwargs)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generates for every prompt; outputs come back in the prompts' order.
        ``lora_request``: one adapter for all prompts, or one (or None) per prompt."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._broadcast_params(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} prompts")
        loras = _broadcast_lora(lora_request, len(prompt_list))
        self._add_requests(prompt_list, params_list, priority, cache_salt, loras)
        return cast(list[RequestOutput], self._run_engine(use_tqdm))

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """One pooled vector per prompt (pooling runner), in the prompts' order."""
        prompt_list = _as_prompt_list(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(task="encode")
        if isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} pooling_params for {len(prompt_list)} prompts"
                )
        loras = _broadcast_lora(lora_request, len(prompt_list))
        self._add_requests(prompt_list, params_list, None, None, loras)
        outputs = self._run_engine(use_tqdm)
        failed = [o for o in outputs if isinstance(o, RequestOutput)]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return cast(list[PoolingRequestOutput], outputs)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), normalised unless the pooler
        config or the params say otherwise."""
        outputs = self.encode(
            prompts,
            pooling_params if pooling_params is not None else PoolingParams(task="embed"),
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        text_1: PromptType | Sequence[PromptType],
        text_2: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """vLLM's embedding-model scoring: the cosine similarity of each pair's embeddings.
        One ``text_1`` pairs with every ``text_2``; otherwise the lists pair up."""
        first, second = _as_prompt_list(text_1), _as_prompt_list(text_2)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise ValueError(f"text_1 has {len(first)} prompts and text_2 {len(second)}")
        embeddings = self.encode([*first, *second], PoolingParams(task="embed", normalize=True),
                                 use_tqdm=use_tqdm)  # fmt: skip
        left, right = embeddings[: len(first)], embeddings[len(first) :]
        return [
            ScoringRequestOutput(
                request_id=f"{a.request_id}-{b.request_id}",
                outputs=ScoringOutput(float((a.outputs.data @ b.outputs.data).item())),
                prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids,
            )
            for a, b in zip(left, right, strict=True)
        ]

    def chat(
        self,
        messages: ChatMessages | Sequence[ChatMessages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if not isinstance(messages, list | tuple):
            raise ValueError(
                "messages must be a list of {'role', 'content'} dicts "
                "or a list of such conversations"
            )
        conversations = cast(
            list[ChatMessages],
            [messages] if not messages or isinstance(messages[0], dict) else list(messages),
        )
        token_prompts: list[PromptType] = []
        policy = media_policy(self.llm_engine.config.multimodal_config)
        for conversation in conversations:
            path = unpaired_surrogate_path(conversation)
            if path is not None:
                field = ".".join(str(part) for part in ("messages", *path))
                raise ValueError(f"{field} {UNPAIRED_SURROGATE}")
            images: list[object] = []
            if has_image_parts(conversation):
                conversation, images = extract_chat_images(list(conversation), policy)
            text = apply_chat_template(
                self.get_tokenizer(),
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )
            # The template already holds any BOS/special tokens: encode it without adding more.
            if images:
                token_prompts.append(
                    cast(
                        PromptType,
                        {
                            "prompt": text,
                            "multi_modal_data": {"image": images},
                            "add_special_tokens": False,
                        },
                    )
                )
            else:
                ids = self.get_tokenizer().encode(text, add_special_tokens=False)
                token_prompts.append({"prompt_token_ids": ids})
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``enable_sleep_mode=True``): frees the KV cache (level 1)
        and the weights too (level 2), keeping the process; call between generate()s."""
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Gives back what sleep freed (``tags``: some of "weights", "kv_cache"); level 2's
        weights are loaded from the model's files again."""
        self.llm_engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm_engine.is_sleeping()

    def get_metrics(self) -> list[Metric]:
        """vLLM's metrics reader: every metric (Counter, Gauge, Vector, Histogram) with its
        ``name`` (``kvserve:...``) and value(s); needs ``LLM(disable_log_stats=False)``."""
        return self.llm_engine.get_metrics()

    def _broadcast_params(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * count
        if len(params) != count:
            raise ValueError(f"got {len(params)} sampling_params for {count} prompts")
        return list(params)

    def _add_requests(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        priority: Sequence[int] | None,
        cache_salt: str | None,
        lora_requests: Sequence[LoRARequest | None],
    ) -> None:
        added: list[str] = []
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                if isinstance(sp, SamplingParams):
                    # Offline callers want one result per request, not a stream.
                    sp = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                request_id = str(next(self._request_counter))
                self.llm_engine.add_request(
                    request_id,
                    prompt,
                    sp,
                    priority=priority[i] if priority else 0,
                    cache_salt=cache_salt,
                    lora_request=lora_requests[i],
                )
                added.append(request_id)
        except Exception:
            # Leave the engine as it was: nothing half-submitted keeps running.
            if added:
                self.llm_engine.abort_request(added)
            raise

    def _run_engine(self, use_tqdm: bool) -> list[AnyRequestOutput]:
        engine = self.llm_engine
        total = len(engine.output_processor.unfinished_request_ids())
        bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        finished: list[AnyRequestOutput] = []
        prompt_tokens = output_tokens = 0
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if not output.finished:
                        continue
                    finished.append(output)
                    bar.update(1)
                    prompt_tokens += len(output.prompt_token_ids or [])
                    if isinstance(output, RequestOutput):
                        output_tokens += sum(len(c.token_ids) for c in output.outputs)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"in: {prompt_tokens / elapsed:.0f} tok/s, "
                        f"out: {output_tokens / elapsed:.0f} tok/s"
                    )
        except BaseException:
            # KeyboardInterrupt or an engine error: free what is still queued.
            leftover = engine.output_processor.unfinished_request_ids()
            if leftover:
                engine.abort_request(leftover)
            raise
        finally:
            bar.close()
        return sorted(finished, key=lambda o: int(o.request_id))


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    return list(prompts)


def _broadcast_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    loras = list(lora_request)
    if len(loras) != count:
        raise ValueError(f"got {len(loras)} lora_requests for {count} prompts")
    return loras
