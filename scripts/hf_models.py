#!/usr/bin/env python3
"""Builds the text-model fixtures in tests/fixtures/onnx/hf/: BERT and
DistilBERT sequence classifiers and a GPT-2 language model from Hugging
Face `transformers`, with small configurations built in code and random
weights from a fixed seed, exported as people export them
(`torch.onnx.export`, its default exporter, which writes the weights to
an external data file `<name>.onnx.data` beside the model), with token ids
and an attention mask in (int64, a padded second sequence), as
`<name>-input_ids.npy` and `<name>-attention_mask.npy`.

device/npu-onnx/tests/ort.rs compiles and runs them against ONNX Runtime;
nothing is downloaded at test time. Run once, by hand, in a venv with the
exporter (CI needs only onnxruntime):

  python3 -m venv .venv-export
  .venv-export/bin/pip install torch==2.15.0 transformers==5.24.0 onnxscript onnx==1.23.2
  .venv-export/bin/python scripts/hf_models.py [NAME...]
"""
import os
import sys

import numpy as np
import torch
import transformers

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "onnx", "hf")
BATCH, SEQ, VOCAB = 2, 16, 1000


class Logits(torch.nn.Module):
    """The model called by keyword (GPT-2's second positional argument is
    its cache), returning the logits."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, input_ids, attention_mask):
        return self.m(input_ids=input_ids, attention_mask=attention_mask).logits


def build(name):
    torch.manual_seed(20261126)
    if name == "bert":
        cfg = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=128, max_position_embeddings=64, num_labels=3,
        )
        m = transformers.BertForSequenceClassification(cfg)
    elif name == "distilbert":
        cfg = transformers.DistilBertConfig(
            vocab_size=VOCAB, dim=64, n_layers=2, n_heads=4, hidden_dim=128, max_position_embeddings=64,
            num_labels=3,
        )
        m = transformers.DistilBertForSequenceClassification(cfg)
    elif name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, use_cache=False)
        m = transformers.GPT2LMHeadModel(cfg)
    else:
        sys.exit(f"hf_models.py: no model `{name}` (bert, distilbert, gpt2)")
    m.eval()
    # Weights scaled up from the configs' 0.02 initialisation, so that the
    # logits are not all near zero (a test of small numbers only).
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(10.0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ * 5 // 8:] = 0  # the second sequence is padded
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"{name}.onnx")
    torch.onnx.export(
        Logits(m).eval(), (ids, mask), path,
        input_names=["input_ids", "attention_mask"], output_names=["logits"],
        dynamic_axes={"input_ids": {0: "batch"}, "attention_mask": {0: "batch"}, "logits": {0: "batch"}},
    )
    np.save(os.path.join(OUT, f"{name}-input_ids.npy"), ids.numpy())
    np.save(os.path.join(OUT, f"{name}-attention_mask.npy"), mask.numpy())
    print(f"{name}: {sum(p.numel() for p in m.parameters())} parameters, ids {list(ids.shape)}")


if __name__ == "__main__":
    for n in sys.argv[1:] or ["bert", "distilbert", "gpt2"]:
        build(n)
