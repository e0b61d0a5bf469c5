"""The embedded calculator: it reads integer arithmetic and nothing else, its syntax round-trips
through the codec, and the scripted warm-start traces call it on the share asked for."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from alignzoo.config.schema import TaskConfig
from alignzoo.rollout.codecs import BracketCodec
from alignzoo.world import calculator
from alignzoo.world.calculator import CalculatorError, evaluate
from alignzoo.world.task import make_examples

NINE_DIGITS = st.integers(-(10**9 - 1), 10**9 - 1)  # any product of two fits in 18 digits


@given(NINE_DIGITS, st.sampled_from("+-*"), NINE_DIGITS)
def test_integer_arithmetic_is_computed_exactly(a, op, b):
    expected = {"+": a + b, "-": a - b, "*": a * b}[op]
    assert evaluate(f"{a}{op}({b})") == expected
    assert evaluate(f" ( {a} ) {op} ({b}) ") == expected


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "only integers"),
        ("2**64", "only integers"),
        ("7/2", "only integers"),
        ("1.5*2", "only integers"),
        ("x*2", "only integers"),
        ("[1]*3", "only integers"),
        ("1" * 19, "more than 18 digits"),
        ("999999999*999999999*999999999", "more than 18 digits"),
        ("1000000000*1000000000", "more than 18 digits"),
        ("(" * 40 + "1" + ")" * 40 + "+1" * 20, "longer than 64"),
        ("12*", "cannot read"),
        ("", "cannot read"),
    ],
)
def test_anything_else_is_refused_with_the_reason(expression, why):
    with pytest.raises(CalculatorError, match=why.replace("*", r"\*")):
        evaluate(expression)


def test_calls_are_read_in_order_and_an_unclosed_one_is_an_error():
    codec = BracketCodec()
    parsed = codec.parse("[12*34] and [5+6]")
    assert [c.arguments["expression"] for c in parsed.calls] == ["12*34", "5+6"]
    assert {c.name for c in parsed.calls} == {calculator.TOOL_NAME} and parsed.errors == ()
    broken = codec.parse("408 [12*3")
    assert broken.calls == () and broken.errors and "not closed" in broken.errors[0]
    assert codec.parse("408").calls == ()
    many = codec.parse("[1+1]" * 20)
    assert len(many.calls) == 16 and "more than 16" in many.errors[-1]


def test_the_codec_writes_tool_answers_as_the_traces_do():
    codec = BracketCodec()
    text = codec.plain_text([{"role": "tool", "name": "calculator", "content": "408"}])
    assert text == "=408\n" == calculator.format_result("408")
    assert codec.plain_text([{"role": "user", "content": "try again"}]) == "try again\n"


def test_a_tool_trace_calls_copies_and_trains_only_on_the_models_part():
    segments = calculator.tool_trace("12*34=")
    assert segments == [("[12*34]", True), ("=408\n", False), ("408", True)]
    assert calculator.direct_trace("408") == [("408", True)]


def test_scripted_demonstrations_call_on_the_share_asked_for_deterministically():
    examples = make_examples(TaskConfig(digits=2, operations=["*"], train_size=2000), "train")
    traces, calls = calculator.scripted_demonstrations(examples, 0.2, seed=0)
    assert len(traces) == len(examples)
    assert 0.17 < calls / len(examples) < 0.23  # binomial(2000, 0.2): 5 standard deviations
    called = [t for t in traces if len(t["segments"]) == 3]
    assert len(called) == calls
    assert (traces, calls) == calculator.scripted_demonstrations(examples, 0.2, seed=0)
    assert traces != calculator.scripted_demonstrations(examples, 0.2, seed=1)[0]
    none, zero = calculator.scripted_demonstrations(examples, 0.0, seed=0)
    assert zero == 0
    assert [t["segments"] for t in none] == [[(e["answer"], True)] for e in examples]


def test_a_prompt_the_calculator_cannot_read_is_answered_directly():
    examples = [{"prompt": "Calculate 47 + 8.", "answer": "55"}, {"prompt": "2*3=", "answer": "6"}]
    traces, calls = calculator.scripted_demonstrations(examples, 1.0, seed=0)
    assert calls == 1 and traces[0]["segments"] == [("55", True)]
    assert traces[1]["segments"] == calculator.tool_trace("2*3=")


def test_auto_never_guesses_the_plain_syntax():
    from alignzoo.errors import UserError
    from alignzoo.rollout.codecs import codec_for
    from alignzoo.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()  # no chat template
    with pytest.raises(UserError, match=r"episodes\.codec: hermes .* or brackets"):
        codec_for(tokenizer, "auto")
    assert codec_for(tokenizer, "brackets").name == "brackets"
