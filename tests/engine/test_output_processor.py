"""Incremental detokenization, stop strings and n > 1 grouping, with a byte-level toy tokenizer."""

from __future__ import annotations

from model_server.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from model_server.engine.output_processor import OutputProcessor
from model_server.engine.outputs import EngineCoreOutput
from model_server.sampling_params import SamplingParams


class ByteTokenizer:
    """Token id i < 256 is the byte i; 256 is a special token. Decodes like a BPE tokenizer:
    incomplete UTF-8 sequences come out as U+FFFD."""

    eos_token_id = 256

    def decode(self, ids, skip_special_tokens=True):
        data = bytes(i for i in ids if i < 256)
        text = data.decode("utf-8", errors="replace")
        if not skip_special_tokens:
            text += "<eos>" * sum(1 for i in ids if i == 256)
        return text


def ids(text: str) -> list[int]:
    return list(text.encode())


def test_multibyte_character_is_never_split() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    deltas = [detok.add_tokens([b]) for b in ids("a€b😀")]
    assert "\ufffd" not in "".join(deltas)
    assert deltas == ["a", "", "", "€", "b", "", "", "", "😀"]
    assert detok.text == "a€b😀"


def test_find_stop_string_only_in_new_text() -> None:
    assert find_stop_string("hello world", ["wor"], 3, False) == ("wor", 6)
    assert find_stop_string("hello world", ["wor"], 3, True) == ("wor", 9)
    assert find_stop_string("hello world", ["hel"], 2, False) is None  # matched earlier text only
    assert find_stop_string("abcxyz", ["xyz", "cx"], 3, False) == ("cx", 2)  # earliest wins


def step(proc, rid, tokens, finish=None):
    outs, to_stop = proc.process_outputs([EngineCoreOutput(rid, tokens, None, finish, None)])
    return (outs[0] if outs else None), to_stop


def test_stop_string_is_held_back_then_cut() -> None:
    proc = OutputProcessor(ByteTokenizer())
    proc.add_request("r", "p", [1], SamplingParams(stop=["STOP"], max_tokens=100))
    streamed = ""
    for ch in "abcST":
        out, to_stop = step(proc, "r", ids(ch))
        streamed += out.outputs[0].text_delta
        assert not to_stop
    # "ST" could start "STOP": only text that cannot be part of it has been released.
    assert streamed == "ab"
    out, to_stop = step(proc, "r", ids("O"))
    streamed += out.outputs[0].text_delta
    out, to_stop = step(proc, "r", ids("P"))
    streamed += out.outputs[0].text_delta
    assert to_stop == ["r"]  # the core must stop it
    assert out.finished and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason == "STOP"
    assert out.outputs[0].text == "abc" == streamed


def test_include_stop_str_in_output() -> None:
    proc = OutputProcessor(ByteTokenizer())
    params = SamplingParams(stop=["!"], include_stop_str_in_output=True, max_tokens=100)
    proc.add_request("r", "p", [1], params)
    out, to_stop = step(proc, "r", ids("hi!"))
    assert out.outputs[0].text == "hi!" and to_stop == ["r"]


def test_length_finish_releases_held_text() -> None:
    proc = OutputProcessor(ByteTokenizer())
    proc.add_request("r", "p", [1], SamplingParams(stop=["xyz"], max_tokens=3))
    out, _ = step(proc, "r", ids("abx"))
    assert out.outputs[0].text_delta == "a"
    out, _ = step(proc, "r", [], finish="length")
    assert out.finished and out.outputs[0].text_delta == "bx"
    assert out.outputs[0].finish_reason == "length"


def test_n_samples_grouped_until_all_finish() -> None:
    proc = OutputProcessor(ByteTokenizer())
    child_ids = proc.add_request("r", "p", [1], SamplingParams(n=2, max_tokens=5))
    assert child_ids == ["0_r", "1_r"]
    outs, _ = proc.process_outputs(
        [
            EngineCoreOutput("0_r", ids("x"), None, "length", None),
            EngineCoreOutput("1_r", ids("y"), None, None, None),
        ]
    )
    assert len(outs) == 1 and not outs[0].finished
    assert [o.text for o in outs[0].outputs] == ["x", "y"]
    outs, _ = proc.process_outputs([EngineCoreOutput("1_r", [*ids("z"), 256], None, "stop", None)])
    assert outs[0].finished
    assert [o.text for o in outs[0].outputs] == ["x", "yz"]
    # Finished requests are forgotten: a late output for them is ignored.
    assert proc.process_outputs([EngineCoreOutput("0_r", [1], None, None, None)]) == ([], [])


def test_special_tokens_skipped_or_kept() -> None:
    proc = OutputProcessor(ByteTokenizer())
    proc.add_request("r", "p", [1], SamplingParams(skip_special_tokens=False))
    out, _ = step(proc, "r", [*ids("ok"), 256, 256])
    assert out.outputs[0].text == "ok<eos><eos>"


def test_the_stop_token_is_left_out_of_the_text_like_vllm() -> None:
    # EOS or a stop_token_ids hit ends the text before it (vLLM), even when special tokens are
    # shown, unless include_stop_str_in_output; token_ids always hold it. "<eos>" and "!" used to
    # be appended (`<|im_end|>` at the end of every chat answer with skip_special_tokens=false).
    cases = [
        (dict(skip_special_tokens=True), 256, "ok"),
        (dict(skip_special_tokens=False), 256, "ok"),
        (dict(skip_special_tokens=False, include_stop_str_in_output=True), 256, "ok<eos>"),
        (dict(stop_token_ids=[ord("!")]), ord("!"), "ok"),
        (dict(stop_token_ids=[ord("!")], include_stop_str_in_output=True), ord("!"), "ok!"),
    ]
    for kwargs, stop_id, expected in cases:
        proc = OutputProcessor(ByteTokenizer())
        proc.add_request("r", "p", [1], SamplingParams(**kwargs))
        streamed = step(proc, "r", ids("o"))[0].outputs[0].text_delta
        out, _ = step(proc, "r", [*ids("k"), stop_id], finish="stop")
        streamed += out.outputs[0].text_delta
        assert out.outputs[0].text == expected == streamed, kwargs
        assert out.outputs[0].token_ids == [*ids("ok"), stop_id]


def test_output_kinds_cumulative_and_delta() -> None:
    from model_server.engine.outputs import TokenLogprobs
    from model_server.sampling_params import RequestOutputKind

    def lp(token: int) -> TokenLogprobs:
        return TokenLogprobs(token, -0.5, [(token, -0.5)])

    proc = OutputProcessor(ByteTokenizer())
    kinds = {"c": RequestOutputKind.CUMULATIVE, "d": RequestOutputKind.DELTA}
    for rid, kind in kinds.items():
        proc.add_request(rid, "p", [1], SamplingParams(max_tokens=3, logprobs=1, output_kind=kind))
    seen: dict[str, list] = {"c": [], "d": []}
    for i, ch in enumerate("xyz"):
        finish = "length" if i == 2 else None
        core = [EngineCoreOutput(rid, ids(ch), [lp(ids(ch)[0])], finish, None) for rid in kinds]
        outs, _ = proc.process_outputs(core)
        for out in outs:
            seen[out.request_id].append(out.outputs[0])
    cumulative, delta = seen["c"], seen["d"]
    assert [o.token_ids for o in cumulative] == [ids("x"), ids("xy"), ids("xyz")]
    assert [len(o.logprobs) for o in cumulative] == [1, 2, 3]
    # Each cumulative output is a copy: later steps do not change what was handed out.
    assert cumulative[0].token_ids is not cumulative[1].token_ids
    # DELTA: deltas and the running count every step; the lists whole in the last output only.
    assert [o.token_ids for o in delta] == [[], [], ids("xyz")]
    assert [o.logprobs for o in delta[:2]] == [[], []] and len(delta[2].logprobs) == 3
    assert [o.token_ids_delta for o in delta] == [ids("x"), ids("y"), ids("z")]
    assert [o.num_token_ids for o in delta] == [1, 2, 3] == [o.num_token_ids for o in cumulative]
    assert [o.text for o in delta] == ["x", "xy", "xyz"]


def test_num_cached_tokens_reaches_the_request_output() -> None:
    proc = OutputProcessor(ByteTokenizer())
    proc.add_request("r", "p", [1] * 40, SamplingParams(max_tokens=2, n=2))
    outs, _ = proc.process_outputs(
        [
            EngineCoreOutput("0_r", ids("a"), None, None, None, num_cached_tokens=16),
            EngineCoreOutput("1_r", ids("b"), None, None, None, num_cached_tokens=32),
        ]
    )
    assert outs[0].num_cached_tokens == 32  # the most over the samples
