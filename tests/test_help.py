"""Every tool's --help is its own: its name as the user typed it, what it does, and a way to see what it cuts."""

from __future__ import annotations

import pytest

from sft import cli
from sft.data import dataset
from sft.data.dataset import show_masks
from sft.options.arguments import DataArguments

COMMANDS = ("data", "chat", "merge")


def help_of(capsys, *argv: str) -> str:
    """The command's --help as printed (argparse's tools exit 0 by SystemExit, the others return 0)."""
    try:
        code = cli.main(list(argv))
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    return capsys.readouterr().out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_names_itself_in_its_help(capsys, command):
    text = help_of(capsys, command, "--help")
    assert text.startswith(f"usage: deepseek-sft {command} ")
    assert "sft/train.py" not in text and "python -m" not in text.splitlines()[0]


def test_data_help_says_what_it_does_and_how_many_examples_it_shows(capsys):
    text = help_of(capsys, "data", "--help")
    assert f"the first {dataset.SHOWN} examples" in text and "--show_masks N" in text and "loads no model" in text
    assert "--dataset_dir" in text and "--overlong" in text
    assert "usage: python -m sft.data.dataset" in (dataset.data_help("short", "python -m sft.data.dataset"))
    assert "--dataset_columns" in help_of(capsys, "data", "--help", "all")


def test_the_toolkit_help_lists_every_command_and_says_where_their_options_are(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "see below" not in text
    for command in ("train", "data", "chat", "merge", "plan"):
        assert f"deepseek-sft {command} " in text
    assert "deepseek-sft COMMAND --help" in text


def test_a_description_cut_short_says_how_to_see_it_whole(capsys):
    from sft.options.arguments import read_options

    with pytest.raises(SystemExit):
        read_options(["--help"])
    text = capsys.readouterr().out
    assert any(line.endswith(" ...") for line in text.splitlines())
    assert "--help all: every option, and each description whole" in text


def test_an_example_with_nothing_kept_says_it_was_dropped_as_too_long():
    from transformers import AutoTokenizer

    from sft.data.chat_templates import get_template
    from sft.model.tiny import ensure_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model())
    args = DataArguments(dataset=["x"], max_length=32, show_masks=1)
    conversation = {"source": "x.json:1", "messages": [{"role": "user", "content": "word " * 100},
                                                       {"role": "assistant", "content": "A"}]}
    text = show_masks([conversation], args, tokenizer, get_template("deepseek", tokenizer))
    assert "(nothing kept: dropped as longer than --max_length 32 with no reply that fits; raise --max_length" in text


def test_an_option_error_of_the_data_tool_points_at_its_own_help(capsys):
    assert cli.main(["data", "--model", "m", "--dataset", "x.json", "--max_lenght", "64"]) == 2
    assert "`deepseek-sft data --help` lists the options" in capsys.readouterr().err
