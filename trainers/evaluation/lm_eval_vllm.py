"""The harness's vLLM backend over an engine alignflow built, the vLLM half of
:mod:`trainers.evaluation.lm_eval_compat` (this module imports vLLM: ``.venv-vllm`` only; contract:
``tests/test_vllm.py``).

lm-eval's ``VLLM`` builds its engine from a model folder; the evaluation's engine
(:class:`~trainers.generation.vllm_engine.ReusedEngine`) already holds the model's weights, so
:class:`EngineLM` is that class with the engine given instead of built: every request is encoded,
batched, scored and cut as the harness's own backend does it. The engine takes token ids and gives
token ids (no tokenizer of its own), so :class:`EngineCalls` turns the harness's stop strings into
post-hoc cuts, which the harness applies to every generation anyway."""

from __future__ import annotations

from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import configure_pad_token
from lm_eval.models.vllm_causallms import VLLM
from vllm import SamplingParams

from trainers.evaluation.lm_eval_compat import LaunchShards
from trainers.models.stop_tokens import eos_token_ids

# Fields of SamplingParams that its __post_init__ derives from the others.
DERIVED_FIELDS = frozenset({"output_text_buffer_length"})


class EngineCalls:
    """What the harness's ``VLLM`` calls of its ``LLM`` (``generate``), on an engine without a tokenizer.

    A log-likelihood request (``detokenize`` off: prompt log-probs only) goes to the engine as it is.
    A generation's stop strings need a detokenizing engine: instead it stops at the model's EOS ids
    (what the harness's engine stops at) and at any token that decodes to a stop string, and its text
    is decoded here without the stop token, as vLLM's detokenizer leaves it out; the harness then
    cuts every text at its first stop string (``postprocess_generated_text``), so a stop string vLLM
    would have found mid-token is cut where it would have stopped."""

    def __init__(self, llm: Any, tokenizer: Any, eos_ids: frozenset[int]):
        self.llm, self.tokenizer, self.eos_ids = llm, tokenizer, eos_ids

    def generate(self, prompts: list, sampling_params: list[SamplingParams], use_tqdm: bool = False, lora_request=None):
        if lora_request is not None:
            raise ValueError("the evaluation's engine serves a LoRA model merged; it takes no LoRA request")
        if not any(params.detokenize for params in sampling_params):
            return self.llm.generate(prompts, sampling_params, use_tqdm=False)
        tokenless = [self.tokenless(params) for params in sampling_params]
        outputs = self.llm.generate(prompts, tokenless, use_tqdm=False)
        for output, params in zip(outputs, tokenless, strict=True):
            for completion in output.outputs:
                tokens = list(completion.token_ids)
                if tokens and tokens[-1] in params.stop_token_ids and not params.include_stop_str_in_output:
                    tokens = tokens[:-1]
                completion.text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
        return outputs

    def tokenless(self, params: SamplingParams) -> SamplingParams:
        """``params`` for an engine without a tokenizer: no stop strings, stop ids for them, no detokenizing."""
        fields = {
            name: getattr(params, name)
            for name in params.__struct_fields__
            if not name.startswith("_") and name not in DERIVED_FIELDS
        }
        stops = set(params.stop_token_ids or ()) | self.stop_tokens(params.stop or [])
        if not params.ignore_eos:
            stops |= self.eos_ids
        return SamplingParams(**fields | {"stop": None, "stop_token_ids": sorted(stops), "detokenize": False})

    def stop_tokens(self, stops: list[str]) -> set[int]:
        """The tokens that decode to one of ``stops`` by themselves: generating one ends the text there."""
        encoded = (self.tokenizer.encode(stop, add_special_tokens=False) for stop in stops)
        singles = {tokens[0] for tokens in encoded if len(tokens) == 1}
        return {token for token in singles if self.tokenizer.decode([token]) in stops}


class EngineLM(LaunchShards, VLLM):
    """lm-eval's vLLM backend over ``llm`` (an engine holding ``model``'s weights), with ``model``'s
    ``tokenizer`` (and its chat template); over the processes of ``state`` where it has several (each
    with an engine of its own). Sets what ``VLLM.__init__`` sets, at its defaults, without building an engine."""

    def __init__(self, llm: Any, model: Any, tokenizer: Any, batch_size: int, state: Any | None = None):
        TemplateLM.__init__(self)
        self.state = state
        self.think_end_token = None
        self._max_length = llm.llm_engine.model_config.max_model_len
        self.tensor_parallel_size = 1
        self.truncation_side = "left"
        self.data_parallel_size = 1
        self.model_args: dict[str, Any] = {}
        self.batch_size = batch_size
        self.model = EngineCalls(llm, tokenizer, frozenset(eos_token_ids(tokenizer, model.generation_config)))
        self.add_bos_token = None
        self._config = model.config
        self.tokenizer = configure_pad_token(tokenizer, model_config=model.config)
        self.chat_template_args: dict[str, Any] = {}
        self.enable_thinking = None
        self.hf_chat_template = None
        self.custom_prefix_token_id = None
        self._max_gen_toks = 256
        self.lora_request = None
