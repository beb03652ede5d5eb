import json
import subprocess
import sys

import pytest

from ringviz.cli import build_parser, main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "ringviz", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for command in ("demo", "equivalence", "perplexity", "streaming", "bench", "conform"):
        assert command in out


def test_demo_json_last_line(capsys):
    assert main(["demo", "--window", "3", "--tokens", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["slot"] for s in result["steps"]] == [0, 1, 2, 0, 1]
    assert [s["evicted"] for s in result["steps"]] == [-1, -1, -1, 0, 1]
    assert result["steps"][-1]["slots"] == [3, 4, 2]


def test_demo_text(capsys):
    main(["demo", "--window", "2", "--tokens", "3"])
    assert "token   2 -> slot  0" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["demo", "--window", "0"],
    ["perplexity", "--windows", "16,x"],
    ["equivalence", "--model", "gpt2", "--window", "8"],
    ["streaming", "--sinks", "0,x"],
    ["streaming", "--past-extra", "-1"],
])
def test_bad_arguments_exit_with_usage_error(argv):
    with pytest.raises(SystemExit) as err:
        build_parser().parse_args(argv)
    assert err.value.code == 2


def test_human_output_tabulates_rows(capsys):
    from ringviz.cli import print_human

    print_human({"device": "cpu", "rows": [{"bench": "update", "impl": "ring", "window": 256,
                                            "median_us": 12.3456}],
                 "figures": {"ratio": 1041.234}})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "device: cpu"
    assert lines[2].split() == ["bench", "impl", "window", "median_us"]
    assert lines[3].split() == ["update", "ring", "256", "12.35"]
    assert lines[-1] == "  ratio: 1041"


def test_bench_generate_cases_parse_and_reject():
    import argparse

    from ringviz.cli import _cases

    assert _cases("1x96,8x2048") == [(1, 96), (8, 2048)]
    for bad in ("8x1", "0x96", "96", "1x96,x", "axb"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxNEW"):
            _cases(bad)
    args = build_parser().parse_args(["bench", "--only", "generate", "--generate-cases", "8x512",
                                      "--generate-reps", "2"])
    assert (args.only, args.generate_cases, args.generate_reps) == ("generate", [(8, 512)], 2)


def test_conform_list_and_exit_status(capsys):
    assert main(["conform", "--list", "--json"]) == 0
    caches = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["caches"]
    names = {c["name"]: c for c in caches}
    assert {"ringviz_ring", "hf_dynamic_sliding", "mlx_rotating", "off_by_one"} <= set(names)
    assert names["off_by_one"]["expect"] == "window" and names["ringviz_ring"]["expect"] == "pass"
    assert names["ringviz_rows"]["rewind"] and names["ringviz_rows"]["layout"] == "rows"
    assert not names["ringviz_ring"]["rewind"] and names["ringviz_ring"]["layout"] == "padded"
    assert main(["conform", "--cache", "ringviz_ring", "--window", "4", "--examples", "5",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["ok"] and result["examples"] == 5 and result["sinks"] == 2
    assert main(["conform", "--cache", "off_by_one", "--window", "4", "--examples", "20"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAIL off_by_one") and "chunks [4]" in out


def test_conform_rejects_unknown_cache_and_sinks_it_cannot_keep(capsys):
    assert main(["conform", "--cache", "nope"]) == 2
    assert "unknown cache 'nope'" in capsys.readouterr().err
    assert main(["conform", "--cache", "hf_dynamic_sliding", "--sinks", "1"]) == 2
    assert "keeps no attention sinks" in capsys.readouterr().err
    assert main(["conform"]) == 2
    assert "--cache" in capsys.readouterr().err


def test_demo_with_a_window_too_large_to_show_is_a_clear_error():
    """``demo --window 10**12`` was a MemoryError traceback: now a clear error, exit 2."""
    done = subprocess.run([sys.executable, "-m", "ringviz", "demo", "--window", str(10**12)],
                          capture_output=True, text=True)
    assert done.returncode == 2
    assert "error: demo shows every slot" in done.stderr and "Traceback" not in done.stderr


def test_demo_into_a_pipe_closed_early_ends_quietly():
    """``demo | head`` was a BrokenPipeError traceback: the demo now stops quietly."""
    command = f"{sys.executable} -m ringviz demo --window 4 --tokens 100000 | head -n 2"
    done = subprocess.run(command,
                          shell=True, capture_output=True, text=True)
    assert len(done.stdout.splitlines()) == 2
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr


@pytest.mark.parametrize(("text", "shown"), [
    ("plain text\n\tindented", "plain text\n\tindented"),
    ("\x1b[2J\x1b]0;title\x07", "\\x1b[2J\\x1b]0;title\\x07"),  # clear screen, set title, bell
    ("over\rwrite \x9b31m", "over\\rwrite \\x9b31m"),  # carriage return, 8-bit CSI
    ("abc\u202edcba", "abc\\u202edcba"),  # a right-to-left override reorders the line
    ("emoji \U0001F600 and é", "emoji \U0001F600 and é"),
])
def test_printable_escapes_what_would_drive_the_terminal(text, shown):
    from ringviz.cli import printable
    assert printable(text) == shown
