"""ringviz.models.chat and the generate/chat commands: a conversation through one RingCache.

A tiny random Gemma 3 and a character-level tokenizer stand in for the real model (the CLI's
real-model run is the chapter's); each turn must equal a fresh generate over the whole
conversation, and a turn stopped by Ctrl-C must leave the conversation as it was.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiny_models import VOCAB, tiny_gemma  # noqa: E402

from ringviz import hf  # noqa: E402
from ringviz.cli import build_parser, main  # noqa: E402
from ringviz.models.chat import Conversation, TextOut, hf_cache_bytes  # noqa: E402


class CharTokenizer:
    """One token per character (codes 1..VOCAB-1); 0 is EOS and padding."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [1 + ord(c) % (VOCAB - 1) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + int(i) % 90) for i in ids if int(i) or not skip_special_tokens)


def _chat():
    return Conversation(tiny_gemma(), CharTokenizer(), sinks=2, stop=None)


def test_each_turn_continues_the_cache_and_equals_a_fresh_run():
    chat = _chat()
    pieces = []
    for text in ("hello there, ring", "and a second, longer turn of text", "ok"):
        result = chat.turn(text, max_new_tokens=9, write=pieces.append)
        assert not result["interrupted"]
        asked = chat.ids[:, :chat.ids.shape[1] - result["new_tokens"]]
        fresh = hf.generate(chat.model, asked, sinks=2, max_new_tokens=9, do_sample=False,
                            pad_token_id=0)
        assert torch.equal(fresh, chat.ids)
    assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1
    assert chat.ids.shape[1] > 3 * chat.cache.window  # the rings wrapped
    assert "".join(pieces).strip()
    assert result["hf_cache_bytes"] == hf_cache_bytes(chat.model, chat.ids.shape[1] - 1)


def test_hf_cache_bytes_is_what_hugging_face_s_default_cache_holds():
    """The conversation through Hugging Face's own DynamicCache, measured after every turn:
    its sliding layers keep W - 1 tokens, its full layer all of them."""
    chat = Conversation(tiny_gemma(), CharTokenizer(), stop=None, baseline=True)
    for text in ("hi", "a longer second turn", "third"):
        chat.turn(text, max_new_tokens=5)
        held = sum(t.numel() * t.element_size() for layer in chat.cache.layers
                   for t in (layer.keys, layer.values))
        assert hf_cache_bytes(chat.model, chat.ids.shape[1] - 1) == held
    assert chat.ids.shape[1] > chat.model.config.sliding_window  # sliding layers were cut


class Pieces:
    """A tokenizer whose tokens are whole strings, to stream chosen text."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids)


@pytest.mark.parametrize(("pieces", "shown"), [
    (["Sure", ".", "\nUs", "er:", " next"], "Sure."),  # the stop string arrives in pieces
    (["Sure", ".", "\nUs", "ually"], "Sure.\nUsually"),  # a false start is shown in the end
    (["a\nUser: b"], "a"),
])
def test_the_stop_string_is_never_streamed(pieces, shown):
    written = []
    out = TextOut(Pieces(pieces), written.append, stop="\nUser:")
    out.put(torch.tensor([0]))  # the prompt
    for i in range(len(pieces)):
        out.put(torch.tensor([i]))
    out.end()
    assert "".join(written) == shown + "\n"


def _twins():
    """Two conversations on one model, one turn in: what a dropped turn is compared with."""
    chat, twin = _chat(), _chat()
    twin.model = chat.model
    twin.cache = type(chat.cache)(chat.model, sinks=2)
    for c in (chat, twin):
        c.turn("first turn", max_new_tokens=6)
    return chat, twin


def test_a_turn_stopped_by_ctrl_c_is_dropped_and_the_conversation_goes_on():
    chat, twin = _twins()
    calls = []

    def stop(text):
        calls.append(text)
        if len(calls) == 3:
            raise KeyboardInterrupt

    result = chat.turn("a turn that is stopped", max_new_tokens=20, write=stop)
    assert result["interrupted"]
    assert torch.equal(chat.ids, twin.ids)
    for c in (chat, twin):
        c.turn("next turn", max_new_tokens=6)
    assert torch.equal(chat.ids, twin.ids)  # as if the stopped turn had never been asked


def test_an_empty_turn_is_refused():
    with pytest.raises(ValueError, match="some text"):
        _chat().turn("   ")


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x"],  # --model is required
    ["generate", "--model", "gpt2", "--prompt", "x"],
    ["generate", "--model", "gemma3"],  # --prompt is required
    ["generate", "--model", "gemma3", "--prompt", "x", "--window", "0"],
    ["chat", "--sinks", "-1"],
    ["chat", "--max-new-tokens", "0"],
])
def test_bad_generate_and_chat_arguments_exit_with_usage_error(argv):
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(argv)
    assert err.value.code == 2


def test_help_lists_generate_and_chat(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "generate" in out and "chat" in out


@pytest.mark.slow
def test_generate_command_streams_gemma3_through_the_ring(capsys):
    import json

    assert main(["generate", "--model", "gemma3", "--prompt", "The harbor light", "--sinks",
                 "2", "--max-new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["window"] == 512 and result["new_tokens"] <= 8 and result["reply"]


def test_the_baseline_conversation_through_hf_default_cache_says_the_same():
    model = tiny_gemma()
    ring = Conversation(model, CharTokenizer(), stop=None)
    base = Conversation(model, CharTokenizer(), stop=None, baseline=True)
    for text in ("one turn", "a second, longer turn than the window"):
        a, b = ring.turn(text, max_new_tokens=7), base.turn(text, max_new_tokens=7)
        assert torch.equal(ring.ids, base.ids)
        assert a["sliding_bytes"] == sum(layer.nbytes for layer in ring.cache.layers
                                         if isinstance(layer, hf.RingLayer))
        assert b["cache_bytes"] > b["sliding_bytes"] > 0


def test_chat_command_holds_the_conversation_and_prints_numbers_each_turn(monkeypatch, capsys):
    import ringviz.cli as cli

    chat = Conversation(tiny_gemma(), CharTokenizer(), sinks=2, stop=None)
    monkeypatch.setattr(cli, "_conversation", lambda args: chat)
    lines = iter(["hello ring", "and again", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--sinks", "2", "--max-new-tokens", "5", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err.count("tokens/s") == 2 and "default cache would hold" in err
    assert '"turns": 2' in out.strip().splitlines()[-1]
    assert chat.cache.get_seq_length() == chat.ids.shape[1] - 1


@pytest.mark.parametrize(("argv", "convention"), [
    (["chat"], "cache"),  # 4 sinks by default: StreamingLLM's positions
    (["chat", "--sinks", "0"], "absolute"),
    (["chat", "--sink-convention", "absolute"], "absolute"),
    (["generate", "--model", "gemma3", "--prompt", "x"], "absolute"),  # no sinks
    (["generate", "--model", "gemma3", "--prompt", "x", "--sinks", "2"], "cache"),
])
def test_the_cli_chooses_the_sink_convention(argv, convention):
    import ringviz.cli as cli
    assert cli._sink_convention(build_parser().parse_args(argv)) == convention


def test_the_cli_refuses_an_unknown_sink_convention(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--sink-convention", "relative"])
    assert "invalid choice" in capsys.readouterr().err


def test_chat_json_prints_one_json_object_last(monkeypatch, capsys):
    """The prompts go to stderr, so stdout's last line is the result, one JSON object (it was
    ``you> {...}``: ``input("you> ")`` writes its prompt to stdout)."""
    import io
    import json

    import ringviz.cli as cli

    chat = Conversation(tiny_gemma(), CharTokenizer(), sinks=2, stop=None)
    monkeypatch.setattr(cli, "_conversation", lambda args: chat)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello ring\nand again\n"))  # then EOF
    assert main(["chat", "--sinks", "2", "--max-new-tokens", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["turns"] == 2
    assert "you>" not in out and err.count("you> ") == 3


class Echo:
    """A conversation that replies with the user's own text (as a model may repeat it)."""

    class cache:  # noqa: N801 - what the command reads of a RingCache
        window, sink_convention, nbytes = 4, "cache", 0

    ids = torch.zeros(1, 0)

    def turn(self, text, *, max_new_tokens, write, **kwargs):
        write(text)
        write("\n")
        return {"interrupted": False, "new_tokens": 1, "tokens_per_s": 1.0,
                "tokens_so_far": 1, "cache_bytes": 0, "hf_cache_bytes": 0}


@pytest.mark.parametrize("command", [["chat"], ["generate", "--model", "gemma3", "--prompt",
                                                "\x1b[2Jwiped \x1b]0;owned\x07"]])
def test_chat_and_generate_never_write_raw_escape_sequences(monkeypatch, capsys, command):
    import io

    import ringviz.cli as cli

    monkeypatch.setattr(cli, "_conversation", lambda args: Echo())
    monkeypatch.setattr("sys.stdin", io.StringIO("\x1b[2Jwiped \x1b]0;owned\x07\n"))
    assert main(command) == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in out + err
    assert "\\x1b[2Jwiped \\x1b]0;owned\\x07" in out


def test_a_turn_whose_write_fails_is_dropped_and_the_conversation_goes_on():
    """``write`` raising OSError (a closed terminal or pipe) part-way: the turn is dropped as a
    Ctrl-C'd one is, the error goes on, and the next turn continues from before it."""
    chat, twin = _twins()
    calls = []

    def broken(text):
        calls.append(text)
        if len(calls) == 3:
            raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        chat.turn("a turn that cannot be shown", max_new_tokens=20, write=broken)
    assert torch.equal(chat.ids, twin.ids)
    for c in (chat, twin):
        c.turn("next turn", max_new_tokens=6)
    assert torch.equal(chat.ids, twin.ids)
