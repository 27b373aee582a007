"""The request models against arbitrary JSON in every field (hypothesis): each body either
validates into values of the field's own type and sampling parameters the engine accepts, or
is refused with an error that names a parameter, never another exception (which the ingress
would answer with a 500)."""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from serve_app.engines.base import InvalidRequestError
from serve_app.serving.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SpeculationUpdate,
    UnsupportedParameter,
)

# JSON as clients send it, and as they should not: huge and negative integers, NaN and
# infinities (Python's json reads them), booleans, strings with lone surrogates, nesting.
ODD_TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=12)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), ODD_TEXT,
)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3),
                    max_leaves=8)
FIELDS = ["model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed", "logprobs",
          "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "stop_token_ids", "min_tokens",
          "repetition_penalty", "speculation"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "robot"]) | JSON, "content": JSON})


def check(model, body: dict) -> None:
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        assert e.errors(), body
        return
    try:
        params = request.sampling_params()
    except (UnsupportedParameter, InvalidRequestError) as e:
        assert e.param, body
        return
    assert isinstance(params.max_tokens, int) and not isinstance(params.max_tokens, bool) and params.max_tokens > 0
    # None: the engine's default applies (engines.base.SamplingParams.with_defaults)
    assert params.temperature is None or (0.0 <= params.temperature <= 2.0 and not math.isnan(params.temperature))
    assert params.top_p is None or 0.0 < params.top_p <= 1.0
    assert all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in params.stop_token_ids)
    assert isinstance(params.min_tokens, int) and 0 <= params.min_tokens <= params.max_tokens
    assert params.seed is None or -(2**63) <= params.seed < 2**64
    assert all(isinstance(s, str) and s.encode("utf-8") for s in params.stop)
    assert isinstance(request.stream, bool | None)
    assert -2.0 <= params.presence_penalty <= 2.0 and -2.0 <= params.frequency_penalty <= 2.0
    assert 0.0 < params.repetition_penalty <= 10.0
    assert all(isinstance(t, int) and t >= 0 and -100 <= v <= 100 for t, v in params.logit_bias.items())
    assert params.logprobs is None or 0 <= params.logprobs <= 20
    assert params.prompt_logprobs is None or params.prompt_logprobs == params.logprobs
    assert params.spec_max_steps is None or 0 <= params.spec_max_steps <= 64


SETTINGS = settings(max_examples=1500, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(FIELDS + ["echo", "best_of", "suffix"]), JSON, max_size=5),
       prompt=JSON)
def test_completions_bodies_validate_or_name_the_parameter(fields, prompt):
    check(CompletionRequest, {"prompt": prompt, **fields})


@SETTINGS
@given(fields=st.dictionaries(st.sampled_from(FIELDS + ["max_completion_tokens", "tools", "top_logprobs"]), JSON, max_size=5),
       messages=st.lists(MESSAGE, max_size=3) | JSON)
def test_chat_bodies_validate_or_name_the_parameter(fields, messages):
    check(ChatCompletionRequest, {"messages": messages, **fields})
    if isinstance(messages, list) and messages:
        try:
            request = ChatCompletionRequest.model_validate({"messages": messages, **fields})
        except ValidationError:
            return
        for m in request.message_dicts():
            assert isinstance(m["content"], str) and m["content"].encode("utf-8") is not None


@SETTINGS
@given(body=st.dictionaries(st.sampled_from(["mode", "num_steps", "policy"]), JSON, max_size=3))
def test_operator_bodies_validate_or_are_refused(body):
    try:
        update = SpeculationUpdate.model_validate(body)
    except ValidationError:
        return
    assert update.num_steps is None or (isinstance(update.num_steps, int) and 0 <= update.num_steps <= 64)
    assert update.mode in (None, "auto", "fixed")
