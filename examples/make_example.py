"""Writes example checkpoints (DataParallel-saved CNN, a training checkpoint, …) into a folder, and `runs/`: a
training run's saves, among them a file its author's code cannot load as saved, for the folder listing."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fixtures.make_fixtures import make_all  # noqa: E402


def make_runs(folder: Path) -> None:
    """Three saves of a run: two plain training checkpoints, one that also holds the script's argparse.Namespace
    (torch.load's defaults refuse it), and the notes a run leaves beside its checkpoints."""
    import torch

    from fixtures.models import make_cnn

    folder.mkdir(parents=True, exist_ok=True)
    model = make_cnn()
    for step in (100, 200):
        torch.save({"state_dict": model.state_dict(), "step": step}, folder / f"step_{step}.pt")
    torch.save({"state_dict": model.state_dict(), "step": 300, "args": argparse.Namespace(lr=0.1, batch_size=64)},
               folder / "step_300.pt")
    (folder / "notes.txt").write_text("lr 0.1, batch 64\n")


def make_hf_folder(folder: Path) -> None:
    """A tiny BERT classifier fine-tuned under DataParallel, saved as such folders are: its config.json beside a
    pytorch_model.bin whose keys carry `module.` (for `--model hf:`; only where transformers is installed)."""
    try:
        import torch
        from transformers import BertConfig, BertForSequenceClassification
    except ImportError:
        return
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                        vocab_size=99, max_position_embeddings=64, num_labels=3,
                        architectures=["BertForSequenceClassification"])
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    config.save_pretrained(folder)
    torch.save(torch.nn.DataParallel(model).state_dict(), folder / "pytorch_model.bin")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("folder", nargs="?", default="example", help="where to write them (default: example)")
    out = Path(parser.parse_args().folder)
    made = make_all(out)
    make_runs(out / "runs")
    make_hf_folder(out / "bert_ft")
    print(f"wrote {len(made)} example checkpoints and a run's saves (runs/) into {out}/", file=sys.stderr)
