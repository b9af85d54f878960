"""A small re-creation of the pytorch/tutorials "Language Translation with nn.Transformer and torchtext"
(``beginner_source/translation_transformer.py``): ``Seq2SeqTransformer`` (token embeddings scaled by sqrt(d),
sinusoidal ``PositionalEncoding`` with dropout, ``nn.Transformer`` in its sequence-first layout, a linear
``generator``), Xavier-uniform initialisation of every matrix, the masks of ``create_mask`` (a float causal
``tgt_mask`` with ``-inf`` above the diagonal, boolean key-padding masks of the source and of the target, the
source's reused as ``memory_key_padding_mask``), teacher forcing (``tgt_input = tgt[:-1]``, ``tgt_out = tgt[1:]``),
``CrossEntropyLoss(ignore_index=PAD_IDX)``, ``Adam(betas=(0.9, 0.98), eps=1e-9)`` and the loop ``logits =
model(...); optimizer.zero_grad(); loss = loss_fn(logits.reshape(-1, V), tgt_out.reshape(-1)); loss.backward();
optimizer.step()``. Two common additions of the original paper (Vaswani et al. 2017) that the tutorial leaves out:
label smoothing 0.1 (so the loss has a floor well above zero) and an inverse-square-root schedule with a linear
warm-up, ``LambdaLR(optimizer, lambda step: min((step + 1) / warmup, sqrt(warmup / (step + 1))))`` stepped after
every optimizer step.

Re-created from the public tutorial for stability's tests, not copied. pytorch/tutorials is distributed under the
BSD 3-Clause licence, Copyright (c) 2017-2022, the PyTorch contributors. The parallel corpus is synthetic (seeded,
generated here) instead of Multi30k, so nothing is downloaded: source sentences of 3-12 tokens from a 28-word
vocabulary (Zipf-like frequencies), each "translated" by reversing the word order and mapping every word through a
fixed permutation of the target vocabulary; special tokens ``<unk>`` 0, ``<pad>`` 1, ``<bos>`` 2, ``<eos>`` 3.

    python tests/scripts/translation.py --steps 200 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on (the group's LR and the scheduler's base LR), ``nan`` puts a NaN in that batch's float ``tgt_mask``
(the data are token ids: the mask is the batch's only float input), ``batch`` replaces that batch's target sentences
by random words (the same lengths).
"""

import argparse
import math

import torch
from torch import nn
from torch.nn import Transformer
from torch.optim.lr_scheduler import LambdaLR

import stability.auto  # noqa: F401  (the only stability line)

UNK_IDX, PAD_IDX, BOS_IDX, EOS_IDX = 0, 1, 2, 3
N_SPECIAL = 4


class PositionalEncoding(nn.Module):
    def __init__(self, emb_size, dropout, maxlen=5000):
        super().__init__()
        den = torch.exp(-torch.arange(0, emb_size, 2) * math.log(10000) / emb_size)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        pos_embedding = torch.zeros((maxlen, emb_size))
        pos_embedding[:, 0::2] = torch.sin(pos * den)
        pos_embedding[:, 1::2] = torch.cos(pos * den)
        pos_embedding = pos_embedding.unsqueeze(-2)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("pos_embedding", pos_embedding)

    def forward(self, token_embedding):
        return self.dropout(token_embedding + self.pos_embedding[:token_embedding.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab_size, emb_size):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, emb_size)
        self.emb_size = emb_size

    def forward(self, tokens):
        return self.embedding(tokens.long()) * math.sqrt(self.emb_size)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, num_encoder_layers, num_decoder_layers, emb_size, nhead, src_vocab_size, tgt_vocab_size,
                 dim_feedforward=512, dropout=0.1):
        super().__init__()
        self.transformer = Transformer(d_model=emb_size, nhead=nhead, num_encoder_layers=num_encoder_layers,
                                       num_decoder_layers=num_decoder_layers, dim_feedforward=dim_feedforward,
                                       dropout=dropout)
        self.generator = nn.Linear(emb_size, tgt_vocab_size)
        self.src_tok_emb = TokenEmbedding(src_vocab_size, emb_size)
        self.tgt_tok_emb = TokenEmbedding(tgt_vocab_size, emb_size)
        self.positional_encoding = PositionalEncoding(emb_size, dropout=dropout)

    def forward(self, src, trg, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(trg))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask, tgt_padding_mask,
                                memory_key_padding_mask)
        return self.generator(outs)


def generate_square_subsequent_mask(sz):
    mask = (torch.triu(torch.ones((sz, sz))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)


def create_mask(src, tgt):
    src_seq_len = src.shape[0]
    tgt_seq_len = tgt.shape[0]
    tgt_mask = generate_square_subsequent_mask(tgt_seq_len)
    src_mask = torch.zeros((src_seq_len, src_seq_len)).type(torch.bool)
    src_padding_mask = (src == PAD_IDX).transpose(0, 1)
    tgt_padding_mask = (tgt == PAD_IDX).transpose(0, 1)
    return src_mask, tgt_mask, src_padding_mask, tgt_padding_mask


def synthetic_corpus(n, vocab, seed):
    """(source, target) token-id lists: Zipf-like words, 3-12 of them; the target reverses the source and maps
    each word through a fixed permutation (seed 0)."""
    perm = torch.randperm(vocab - N_SPECIAL, generator=torch.Generator().manual_seed(0)) + N_SPECIAL
    gen = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, vocab - N_SPECIAL + 1)
    pairs = []
    for _ in range(n):
        length = int(torch.randint(3, 13, (1,), generator=gen))
        src = (torch.multinomial(weights, length, replacement=True, generator=gen) + N_SPECIAL).tolist()
        tgt = [int(perm[w - N_SPECIAL]) for w in reversed(src)]
        pairs.append((src, tgt))
    return pairs


def collate_fn(batch):
    """``<bos> ... <eos>`` around each sentence, padded with ``<pad>``: (seq, batch) tensors, as in the tutorial."""
    def pad(seqs):
        seqs = [[BOS_IDX, *s, EOS_IDX] for s in seqs]
        longest = max(len(s) for s in seqs)
        return torch.tensor([s + [PAD_IDX] * (longest - len(s)) for s in seqs]).T
    return pad([s for s, _ in batch]), pad([t for _, t in batch])


def batches(pairs, batch_size, gen):
    order = torch.randperm(len(pairs), generator=gen).tolist()
    for i in range(0, len(pairs) - batch_size + 1, batch_size):
        yield collate_fn([pairs[j] for j in order[i:i + batch_size]])


def train_epoch(args, model, optimizer, scheduler, loss_fn, data, epoch, state):
    model.train()
    losses = 0
    n = 0
    for src, tgt in data:
        if state["step"] >= args.steps:
            break
        if args.fault == "lr" and state["step"] == args.fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
            scheduler.base_lrs = [lr * 100 for lr in scheduler.base_lrs]
        if args.fault == "batch" and state["step"] == args.fault_step:
            words = torch.randint_like(tgt, N_SPECIAL, args.vocab)
            tgt = torch.where(tgt >= N_SPECIAL, words, tgt)
        tgt_input = tgt[:-1, :]
        src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
        if args.fault == "nan" and state["step"] == args.fault_step:
            tgt_mask[2, 1] = float("nan")
        logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
        optimizer.zero_grad()
        tgt_out = tgt[1:, :]
        loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt_out.reshape(-1))
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses += loss.item()
        n += 1
        state["step"] += 1
        if state["step"] % args.log_interval == 0:
            print(f"Epoch {epoch} step {state['step']}: train loss {loss.item():.3f}, "
                  f"lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
    return losses / max(n, 1)


def evaluate(model, loss_fn, data):
    model.eval()
    losses = 0
    n = 0
    with torch.no_grad():
        for src, tgt in data:
            tgt_input = tgt[:-1, :]
            src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input)
            logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask,
                           src_padding_mask)
            losses += loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[1:, :].reshape(-1)).item()
            n += 1
    return losses / max(n, 1)


def main():
    parser = argparse.ArgumentParser(description="Translation with nn.Transformer (small, synthetic corpus)")
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--emb-size", type=int, default=64)
    parser.add_argument("--nhead", type=int, default=4)
    parser.add_argument("--ffn-hid-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--train-size", type=int, default=1600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-interval", type=int, default=25)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    if args.fault_step is None:
        args.fault_step = int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    train_pairs = synthetic_corpus(args.train_size, args.vocab, seed=1)
    val_pairs = synthetic_corpus(128, args.vocab, seed=2)
    transformer = Seq2SeqTransformer(args.layers, args.layers, args.emb_size, args.nhead, args.vocab, args.vocab,
                                     args.ffn_hid_dim)
    for p in transformer.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=PAD_IDX, label_smoothing=args.label_smoothing)
    optimizer = torch.optim.Adam(transformer.parameters(), lr=args.lr, betas=(0.9, 0.98), eps=1e-9)
    warmup = args.warmup
    scheduler = LambdaLR(optimizer, lambda step: min((step + 1) / warmup, math.sqrt(warmup / (step + 1))))
    gen = torch.Generator().manual_seed(args.seed)
    state = {"step": 0}
    epoch = 1
    while state["step"] < args.steps:
        train_loss = train_epoch(args, transformer, optimizer, scheduler, loss_fn,
                                 batches(train_pairs, args.batch_size, gen), epoch, state)
        val_loss = evaluate(transformer, loss_fn, batches(val_pairs, args.batch_size, gen))
        print(f"Epoch: {epoch}, Train loss: {train_loss:.3f}, Val loss: {val_loss:.3f}", flush=True)
        epoch += 1


if __name__ == "__main__":
    main()
