"""``python -m gradest_digits.mnist_pretrain``: the MNIST (28x28) workload's two checkpoints.

It trains the classifier, then the class-conditional DiT, on the 4,000 training digits of
:data:`gradest_digits.datasets.MNIST` (seeded, single-threaded CPU) with the pretraining
the 8x8 digits use (:func:`gradest_digits.pretrain.pretrain_assets`), and writes
``mnist_classifier.pt`` and ``mnist_dit.pt`` to ``apps/digits/gradest_digits/assets/``
(``--out-dir`` elsewhere). The DiT is ``DiT.from_config("digits")`` (28x28x1, 4x4
patches: 49 tokens, hidden 128, depth 3, 4 heads, about 0.96M parameters); its evaluation
is the accuracy of the new classifier on conditional samples (``RectifiedFlow(20)``),
overall and per class. Each file it writes is held as ``gradest pretrain`` holds its
``--out`` (:func:`gradest_digits.pretrain.claim_output_file`): a lock beside it for the
run, and an existing file replaced only when it is a checkpoint of the same kind.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradest import GradestError
from gradest_digits.datasets import MNIST
from gradest_digits.pretrain import ASSET_WHATS, pretrain_assets

# The command its lock files name.
COMMAND = "python -m gradest_digits.mnist_pretrain"


def mnist_pretrain(
    out_dir: str | Path | None = None,
    *,
    what: str = "all",
    seed: int = 0,
    dit_steps: int = MNIST.dit_steps,
    classifier_epochs: int = MNIST.classifier_epochs,
    progress: bool = True,
) -> dict[str, Any]:
    """:func:`~gradest_digits.pretrain.pretrain_assets` of :data:`MNIST`, its locks naming
    this command."""
    return pretrain_assets(
        MNIST,
        out_dir,
        what=what,
        seed=seed,
        dit_steps=dit_steps,
        classifier_epochs=classifier_epochs,
        progress=progress,
        command=COMMAND,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Pretrain the MNIST workload's classifier and DiT and save the checkpoints.",
    )
    parser.add_argument("--out-dir", default=None, help="folder (default: the package assets)")
    parser.add_argument("--what", choices=ASSET_WHATS, default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dit-steps", type=int, default=MNIST.dit_steps)
    parser.add_argument("--classifier-epochs", type=int, default=MNIST.classifier_epochs)
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        result = mnist_pretrain(
            args.out_dir,
            what=args.what,
            seed=args.seed,
            dit_steps=args.dit_steps,
            classifier_epochs=args.classifier_epochs,
            progress=not args.quiet,
        )
    except GradestError as err:
        print(f"mnist_pretrain: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
