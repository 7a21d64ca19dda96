"""Draw the figures the README shows, with attnx.plot.

    python examples/make_figures.py [--out DIR]

writes DIR/weights.png (DIR defaults to docs/images/ of this checkout):
the weights of the same 16 queries and keys under softmax, Gaussian,
linear (elu + 1), Taylor and cosFormer attention within a window of 4 keys
on either side, on one colour scale, the cells the window hides in grey.
"""
import argparse
import os

import matplotlib
import numpy as np

matplotlib.use("Agg")

import attnx.plot  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights_figure():
    rng = np.random.default_rng(7)
    n, d = 16, 16
    q = rng.standard_normal((n, d))
    k = rng.standard_normal((n, d))
    variants = ["softmax", ("gaussian", {"sigma": 3.0}), "linear", "taylor", "cosformer"]
    fig = attnx.plot.compare(q, k, variants, window=4, panel_size=3.0)
    fig.suptitle("attention weights of the same queries and keys, window=4 (grey: hidden)")
    return fig


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"), help="output directory")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "weights.png")
    # no software version in the file: rerunning the script rewrites the same bytes
    weights_figure().savefig(path, dpi=100, metadata={"Software": None})
    print("wrote", path)


if __name__ == "__main__":
    main()
