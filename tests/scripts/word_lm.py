"""A small re-creation of pytorch/examples ``word_language_model`` (``main.py``, ``model.py``, ``data.py``): an LSTM
language model trained with a hand-written SGD update (no ``torch.optim``), gradient clipping, truncated BPTT with
``repackage_hidden`` and the learning rate divided by 4 whenever the validation loss stops improving.

Re-created from the public example for stability's tests, not copied; the structure and defaults follow the
original (lr 20, clip 0.25, bptt 35 -> 20 here, uniform(-0.1, 0.1) init). pytorch/examples is distributed under
the BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The corpus is synthetic (a seeded
Markov chain of words, generated here) instead of Wikitext-2, and the model is tiny so the script runs in seconds
on a CPU.

    python tests/scripts/word_lm.py --steps 300 --fault none|lr|nan|batch

The fault is injected at ``--fault-step`` (default 60 % of ``--steps``): ``lr`` multiplies the learning rate by 100
from then on, ``nan`` poisons the embedding row of one input token, ``batch`` feeds one batch of random tokens.
"""

import argparse
import math
import time

import torch
import torch.nn as nn

import stability.auto  # noqa: F401  (the only stability line)

# ------------------------------------------------------------------------------------------------- data.py


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    """Tokenizes lines of words (an ``<eos>`` after each line), like the original's ``Corpus`` over text files."""

    def __init__(self, train_lines, valid_lines):
        self.dictionary = Dictionary()
        self.train = self.tokenize(train_lines)
        self.valid = self.tokenize(valid_lines)

    def tokenize(self, lines):
        ids = []
        for line in lines:
            for word in [*line.split(), "<eos>"]:
                ids.append(self.dictionary.add_word(word))
        return torch.tensor(ids, dtype=torch.int64)


def synthetic_lines(n_lines, seed, vocab=60):
    """Sentences from a fixed sparse Markov chain over ``vocab`` words (learnable, not trivial)."""
    chain = torch.Generator().manual_seed(1234)  # the same "language" for train and valid
    successors = torch.randint(0, vocab, (vocab, 3), generator=chain)
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(n_lines):
        word = int(torch.randint(0, vocab, (1,), generator=gen))
        words = []
        for _ in range(int(torch.randint(4, 12, (1,), generator=gen))):
            words.append(f"w{word}")
            word = int(successors[word, int(torch.randint(0, 3, (1,), generator=gen))])
        lines.append(" ".join(words))
    return lines


# ------------------------------------------------------------------------------------------------ model.py


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, rnn_type, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout if nlayers > 1 else 0.0)
        self.decoder = nn.Linear(nhid, ntoken)
        self.init_weights()
        self.rnn_type = rnn_type
        self.nhid = nhid
        self.nlayers = nlayers

    def init_weights(self):
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output)
        decoded = decoded.view(-1, self.ntoken)
        return nn.functional.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


# ------------------------------------------------------------------------------------------------- main.py


def parse_args():
    parser = argparse.ArgumentParser(description="tiny word-level LSTM language model (hand-written SGD)")
    parser.add_argument("--steps", type=int, default=300, help="training batches in all")
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    parser.add_argument("--emsize", type=int, default=32)
    parser.add_argument("--nhid", type=int, default=32)
    parser.add_argument("--nlayers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=20)
    parser.add_argument("--clip", type=float, default=0.25)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--bptt", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=1111)
    parser.add_argument("--log-interval", type=int, default=100)
    return parser.parse_args()


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts, trim off the remainder, evenly divide.
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    return data.view(bsz, -1).t().contiguous()


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i, bptt):
    seq_len = min(bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def main():  # noqa: C901  (one long function, as in the original)
    args = parse_args()
    torch.manual_seed(args.seed)
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)
    corpus = Corpus(synthetic_lines(600, seed=1), synthetic_lines(80, seed=2))
    eval_batch_size = 10
    train_data = batchify(corpus.train, args.batch_size)
    val_data = batchify(corpus.valid, eval_batch_size)
    ntokens = len(corpus.dictionary)
    model = RNNModel("LSTM", ntokens, args.emsize, args.nhid, args.nlayers, args.dropout)
    criterion = nn.NLLLoss()

    def evaluate(data_source):
        model.eval()  # Turn on evaluation mode which disables dropout.
        total_loss = 0.0
        hidden = model.init_hidden(eval_batch_size)
        with torch.no_grad():
            for i in range(0, data_source.size(0) - 1, args.bptt):
                data, targets = get_batch(data_source, i, args.bptt)
                output, hidden = model(data, hidden)
                hidden = repackage_hidden(hidden)
                total_loss += len(data) * criterion(output, targets).item()
        return total_loss / (len(data_source) - 1)

    lr = args.lr
    step = 0

    def train(epoch):
        nonlocal lr, step
        model.train()  # Turn on training mode which enables dropout.
        total_loss = 0.0
        start_time = time.time()
        hidden = model.init_hidden(args.batch_size)
        for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
            if step >= args.steps:
                return
            data, targets = get_batch(train_data, i, args.bptt)
            if args.fault == "batch" and step == fault_step:  # one batch of random tokens
                data = torch.randint_like(data, ntokens)
                targets = torch.randint_like(targets, ntokens)
            if args.fault == "nan" and step == fault_step:  # a corrupted embedding row
                model.encoder.weight.data[data[0, 0]] = float("nan")
            if args.fault == "lr" and step == fault_step:
                lr *= 100
            # Starting each batch, we detach the hidden state from how it was previously produced.
            # If we didn't, the model would try backpropagating all the way to start of the dataset.
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()

            # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)

            total_loss += loss.item()
            step += 1
            if batch % args.log_interval == 0 and batch > 0:
                cur_loss = total_loss / args.log_interval
                elapsed = time.time() - start_time
                print(f"| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | lr {lr:02.2f} | "
                      f"ms/batch {elapsed * 1000 / args.log_interval:5.2f} | loss {cur_loss:5.2f}", flush=True)
                total_loss = 0
                start_time = time.time()

    best_val_loss = None
    epoch = 0
    while step < args.steps:
        epoch += 1
        epoch_start_time = time.time()
        train(epoch)
        val_loss = evaluate(val_data)
        ppl = math.exp(val_loss) if math.isfinite(val_loss) and val_loss < 700 else float("inf")
        print(f"| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s | "
              f"valid loss {val_loss:5.2f} | valid ppl {ppl:8.2f}", flush=True)
        # Save the model if the validation loss is the best we've seen so far.
        if not best_val_loss or val_loss < best_val_loss:
            best_val_loss = val_loss
        else:
            # Anneal the learning rate if no improvement has been seen in the validation dataset.
            lr /= 4.0
    print(f"trained {step} steps", flush=True)


if __name__ == "__main__":
    main()
