"""examples/train_char_model.py: a short run of each attention kind learns
(the training loss falls well below its start, and the held-out loss
below uniform guessing)."""
import importlib.util
import math
import os

import pytest

torch = pytest.importorskip("torch")


EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "train_char_model.py")


def load_example():
    spec = importlib.util.spec_from_file_location("train_char_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("attention", ["softmax", "linear", "cosformer"])
def test_short_training_run_learns(attention):
    example = load_example()
    alphabet, _, _ = example.load_text()
    losses, held_out, _ = example.train(attention, steps=30, batch=8, context=32, lr=1e-2, log=None)
    uniform = math.log(len(alphabet))
    assert losses[0] > uniform - 0.5            # starts near guessing
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert held_out < uniform - 1.0


def test_help_describes_every_option_with_its_default():
    import re
    import subprocess
    import sys

    result = subprocess.run([sys.executable, EXAMPLE, "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    # each option's entry: from its line to the next option's
    entries = {match.group(1): " ".join(match.group(0).split())
               for match in re.finditer(r"^  (--[a-z]+).*?(?=^  -|\Z)", result.stdout, re.S | re.M)}
    for option, default in [("--attention", "['softmax', 'linear', 'cosformer']"),
                            ("--steps", "300"), ("--batch", "16"), ("--context", "64"),
                            ("--seed", "0")]:
        entry = entries[option]
        assert entry.endswith(f"(default: {default})"), entry
        description = entry[:-len(f"(default: {default})")].split("}")[-1]
        assert len(description.split()) >= 4, entry  # words beyond the option's name
