"""A small re-creation of huggingface/transformers ``examples/pytorch/text-classification/run_glue_no_trainer.py``
fine-tuning a "pre-trained" encoder on a sentence-classification task, with the layer freezing of the usual
transfer-learning recipe: the embeddings and all encoder layers but the last are frozen (``requires_grad_(False)``),
the last encoder layer is fine-tuned at the base LR and the new classification head at 10x; the example's parameter
groups (``no_decay = ["bias", "LayerNorm.weight"]``: weight decay on the weight matrices only) for each of the two,
``AdamW``, ``get_scheduler("linear")`` (a linear warm-up over the first 10 % of the optimizer steps, then linear
decay to 0; written out here as the ``LambdaLR`` it is), gradient accumulation ``loss = loss /
gradient_accumulation_steps; loss.backward()`` with ``optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()``
every ``gradient_accumulation_steps`` (2) batches, in one process (no ``accelerator``).

Re-created from the public example for stability's tests, not copied. huggingface/transformers is distributed under
the Apache License 2.0, Copyright 2021 The HuggingFace Inc. team. The encoder is a small ``nn.TransformerEncoder``
(not BERT) whose frozen part is randomly initialised and seeded (a stand-in for downloaded weights), and the task is
synthetic (seeded, generated here: a sentence is positive when it holds one of 8 keywords), so nothing is downloaded.

    python tests/scripts/finetune.py --steps 200 --fault none|lr|nan|batch

``--steps`` counts optimizer steps (2 batches each). The fault is injected at ``--fault-step`` (default 60 % of
``--steps``): ``lr`` multiplies every group's learning rate by 100 from then on (the scheduler's base LRs too, so it
stays), ``nan`` puts a NaN in one word embedding of that step's first batch (a frozen layer's output), ``batch``
gives both of that step's batches random tokens and flipped labels.
"""

import argparse
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

import stability.auto  # noqa: F401  (the only stability line)

VOCAB, PAD, CLS, KEYWORDS = 200, 0, 1, 8


class Embeddings(nn.Module):
    def __init__(self, d_model, max_len):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.position_embeddings = nn.Embedding(max_len, d_model)
        self.LayerNorm = nn.LayerNorm(d_model)

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1]).unsqueeze(0)
        return self.LayerNorm(self.word_embeddings(input_ids) + self.position_embeddings(positions))


class SequenceClassifier(nn.Module):
    """Embeddings, an encoder, the first token's state through ``dense -> tanh`` (a pooler) and a classifier."""

    def __init__(self, d_model=64, n_layers=3, n_heads=4, max_len=32, num_labels=2):
        super().__init__()
        self.embeddings = Embeddings(d_model, max_len)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.pooler = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(0.1)
        self.classifier = nn.Linear(d_model, num_labels)

    def forward(self, input_ids, attention_mask, labels=None):
        hidden = self.encoder(self.embeddings(input_ids), src_key_padding_mask=attention_mask == 0)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))
        logits = self.classifier(self.dropout(pooled))
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return loss, logits


def synthetic_task(n, max_len, gen):
    """Sentences of 8..max_len tokens after [CLS]; label 1 when one of the ``KEYWORDS`` words (ids 2..9) occurs
    (about half the sentences)."""
    lengths = torch.randint(8, max_len, (n,), generator=gen)
    ids = torch.randint(2, VOCAB, (n, max_len), generator=gen)
    mask = (torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, PAD))
    ids[:, 0] = CLS
    keywords = ((ids >= 2) & (ids < 2 + KEYWORDS) & mask.bool()).sum(1)
    return ids, mask, (keywords > 0).long()


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps):
    def lr_lambda(current_step):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps)))

    return LambdaLR(optimizer, lr_lambda)


def main():  # noqa: C901  (one long function, as in the original)
    parser = argparse.ArgumentParser(description="Fine-tune a sequence classifier with frozen layers (small)")
    parser.add_argument("--per-device-train-batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--head-lr-multiplier", type=float, default=10.0)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--gradient-accumulation-steps", type=int, default=2)
    parser.add_argument("--warmup-ratio", type=float, default=0.1)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--train-size", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--log-interval", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--loss-log", default=None, help="write 'step loss' per optimizer step (for the tests)")
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(0)  # the "pre-trained" weights: the same for every --seed
    model = SequenceClassifier(max_len=args.max_length)
    torch.manual_seed(args.seed)
    model.pooler.reset_parameters()  # a new head, as from_pretrained(num_labels=...) initialises it
    model.classifier.reset_parameters()

    # Freeze everything but the last encoder layer and the head
    model.embeddings.requires_grad_(False)
    for layer in model.encoder.layers[:-1]:
        layer.requires_grad_(False)
    head = {"pooler", "classifier"}
    no_decay = ["bias", "LayerNorm.weight", "norm1.weight", "norm2.weight"]
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer_grouped_parameters = []
    for is_head, lr in ((False, args.learning_rate), (True, args.learning_rate * args.head_lr_multiplier)):
        part = [(n, p) for n, p in trainable if (n.split(".")[0] in head) is is_head]
        optimizer_grouped_parameters += [
            {"params": [p for n, p in part if not any(nd in n for nd in no_decay)],
             "weight_decay": args.weight_decay, "lr": lr},
            {"params": [p for n, p in part if any(nd in n for nd in no_decay)], "weight_decay": 0.0, "lr": lr},
        ]
    optimizer = torch.optim.AdamW(optimizer_grouped_parameters, lr=args.learning_rate)
    num_warmup_steps = math.ceil(args.warmup_ratio * args.steps)
    lr_scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps, args.steps)

    gen = torch.Generator().manual_seed(args.seed)
    input_ids, attention_mask, labels = synthetic_task(args.train_size, args.max_length, gen)
    bs = args.per_device_train_batch_size
    log = open(args.loss_log, "w") if args.loss_log else None
    completed_steps, running = 0, 0.0
    model.train()
    epoch = 0
    while completed_steps < args.steps:
        order = torch.randperm(len(labels), generator=gen)
        for step in range(len(labels) // bs):
            idx = order[step * bs:(step + 1) * bs]
            batch = {"input_ids": input_ids[idx], "attention_mask": attention_mask[idx], "labels": labels[idx]}
            first = step % args.gradient_accumulation_steps == 0
            if args.fault == "lr" and completed_steps == args.fault_step and first:
                for group in optimizer.param_groups:
                    group["lr"] *= 100
                lr_scheduler.base_lrs = [lr * 100 for lr in lr_scheduler.base_lrs]
            if args.fault == "batch" and completed_steps == args.fault_step:
                batch["input_ids"] = torch.randint(2, VOCAB, batch["input_ids"].shape) * batch["attention_mask"]
                batch["input_ids"][:, 0] = CLS
                batch["labels"] = 1 - batch["labels"]
            if args.fault == "nan" and completed_steps == args.fault_step and first:
                with torch.no_grad():
                    saved = model.embeddings.word_embeddings.weight[5].clone()
                    model.embeddings.word_embeddings.weight[5, 0] = float("nan")
                batch["input_ids"][0, 3] = 5
            loss, _ = model(**batch)
            if args.fault == "nan" and completed_steps == args.fault_step and first:
                with torch.no_grad():
                    model.embeddings.word_embeddings.weight[5] = saved
            running += loss.item()
            loss = loss / args.gradient_accumulation_steps
            loss.backward()
            if (step + 1) % args.gradient_accumulation_steps == 0:
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
                if log:
                    log.write(f"{completed_steps} {running / args.gradient_accumulation_steps:.9g}\n")
                if completed_steps % args.log_interval == 0:
                    print(f"epoch {epoch} step {completed_steps} loss {running / args.gradient_accumulation_steps:.4f}"
                          f" lr {lr_scheduler.get_last_lr()[0]:.3g}", flush=True)
                running = 0.0
                completed_steps += 1
                if completed_steps >= args.steps:
                    break
        epoch += 1
    if log:
        log.close()


if __name__ == "__main__":
    main()
