"""python -m attnx, the README's first command: every variant against
numpy, and no timing column (a best-of-3 of calls this small says little
about speed; the demo points at benchmarks/ instead)."""
import subprocess
import sys


def test_the_demo_checks_every_variant_and_leaves_speed_to_the_benchmarks(tmp_path):
    result = subprocess.run([sys.executable, "-m", "attnx"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.split() == ["variant", "max", "|diff|"])
    rows = lines[lines.index(header) + 1:lines.index("all variants agree with numpy") - 1]
    assert len(rows) > 10
    for row in rows:  # the variant's name, then one column: the difference
        assert len(row[28:].split()) == 1 and float(row[28:]) < 1e-10, row
    assert "all variants agree with numpy" in lines
    assert lines[-1] == "Speed: python benchmarks/run.py --quick from a checkout (benchmarks/README.md)"
