"""A small re-creation of pytorch/examples ``gat/main.py``: a two-layer graph attention network (``GraphAttentionLayer``
written out: a shared linear map ``W``, per-head attention vectors ``a``, LeakyReLU(0.2) scores masked to the
adjacency, softmax, dropout on the features and on the attention; 8 heads averaged in the first layer, ELU, one head
in the second, ``log_softmax``), trained full-batch, one optimizer step per epoch: ``model.train();
optimizer.zero_grad(); output = model(features, adj); loss = NLLLoss(output[idx_train], labels[idx_train]);
loss.backward(); optimizer.step()``, then the train and validation loss and accuracy under ``model.eval()`` and
``no_grad`` every epoch, with ``Adam(lr=0.005, weight_decay=5e-4)`` and dropout 0.6 (the training loss is noisy).

Re-created from the public example for stability's tests, not copied. pytorch/examples is distributed under the
BSD 3-Clause licence, Copyright (c) 2017, the PyTorch contributors. The graph is synthetic, Cora-like but smaller
(a seeded stochastic block model: 7 classes, 400 nodes, edges mostly within a class, sparse binary bag-of-words
features drawn from class-dependent word probabilities, generated here) instead of Cora, so nothing is downloaded.

    python tests/scripts/gat.py --steps 200 --fault none|lr|nan|batch

``--steps`` is the number of epochs (one step each). The fault is injected at ``--fault-step`` (default 60 % of
``--steps``): ``lr`` multiplies the learning rate by 100 from then on, ``nan`` puts a NaN in one feature of one
node for that epoch, ``batch`` gives that epoch's training nodes random labels.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import stability.auto  # noqa: F401  (the only stability line)


class GraphAttentionLayer(nn.Module):
    def __init__(self, in_features, out_features, n_heads, concat=False, dropout=0.4, leaky_relu_slope=0.2):
        super().__init__()
        self.n_heads = n_heads
        self.concat = concat
        self.dropout = dropout
        if concat:
            self.out_features = out_features
            assert out_features % n_heads == 0
            self.n_hidden = out_features // n_heads
        else:
            self.n_hidden = out_features
        self.W = nn.Parameter(torch.empty(size=(in_features, self.n_hidden * n_heads)))
        self.a = nn.Parameter(torch.empty(size=(n_heads, 2 * self.n_hidden, 1)))
        self.leakyrelu = nn.LeakyReLU(leaky_relu_slope)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_normal_(self.W)
        nn.init.xavier_normal_(self.a)

    def _get_attention_scores(self, h_transformed):
        source_scores = torch.matmul(h_transformed, self.a[:, : self.n_hidden, :])
        target_scores = torch.matmul(h_transformed, self.a[:, self.n_hidden :, :])
        e = source_scores + target_scores.mT  # (n_heads, n_nodes, n_nodes)
        return self.leakyrelu(e)

    def forward(self, h, adj_mat):
        n_nodes = h.shape[0]
        h_transformed = torch.mm(h, self.W)
        h_transformed = F.dropout(h_transformed, self.dropout, training=self.training)
        h_transformed = h_transformed.view(n_nodes, self.n_heads, self.n_hidden).permute(1, 0, 2)
        e = self._get_attention_scores(h_transformed)
        connectivity_mask = -9e16 * torch.ones_like(e)
        e = torch.where(adj_mat > 0, e, connectivity_mask)
        attention = F.softmax(e, dim=-1)
        attention = F.dropout(attention, self.dropout, training=self.training)
        h_prime = torch.matmul(attention, h_transformed)
        if self.concat:
            return h_prime.permute(1, 0, 2).contiguous().view(n_nodes, self.out_features)
        return h_prime.mean(dim=0)


class GAT(nn.Module):
    def __init__(self, in_features, n_hidden, n_heads, num_classes, concat=False, dropout=0.4, leaky_relu_slope=0.2):
        super().__init__()
        self.gat1 = GraphAttentionLayer(in_features, n_hidden, n_heads, concat, dropout, leaky_relu_slope)
        self.gat2 = GraphAttentionLayer(n_hidden, num_classes, 1, False, dropout, leaky_relu_slope)

    def forward(self, input_tensor, adj_mat):
        x = self.gat1(input_tensor, adj_mat)
        x = F.elu(x)
        x = self.gat2(x, adj_mat)
        return F.log_softmax(x, dim=1)


def synthetic_cora(n_nodes=400, n_classes=7, n_words=500, seed=0):
    """A stochastic block model: ~4 edges per node, 80 % of them within the node's class; binary bag-of-words
    features, ~12 words a node, a quarter of them from its class's 40 topic words."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, n_classes, (n_nodes,), generator=gen)
    same = labels[:, None] == labels[None, :]
    p = torch.where(same, 0.8 * 4 / (n_nodes / n_classes), 0.2 * 4 / n_nodes)
    edges = torch.rand(n_nodes, n_nodes, generator=gen) < p
    adj = torch.triu(edges, 1)
    adj = (adj | adj.T | torch.eye(n_nodes, dtype=torch.bool)).float()  # symmetric, self-loops
    topic = torch.zeros(n_classes, n_words)
    for c in range(n_classes):
        topic[c, torch.randperm(n_words, generator=gen)[:40]] = 1
    word_p = 9 / n_words + topic[labels] * 3 / 40
    features = (torch.rand(n_nodes, n_words, generator=gen) < word_p).float()
    return features, adj, labels


def test(model, criterion, features, adj, target, mask):
    model.eval()
    with torch.no_grad():
        output = model(features, adj)
        loss = criterion(output[mask], target[mask]).item()
        acc = (output[mask].argmax(dim=1) == target[mask]).float().mean().item()
    return loss, acc


def main():
    parser = argparse.ArgumentParser(description="PyTorch Graph Attention Network (small, synthetic graph)")
    parser.add_argument("--lr", type=float, default=0.005)
    parser.add_argument("--l2", type=float, default=5e-4)
    parser.add_argument("--dropout-p", type=float, default=0.6)
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--concat-heads", action="store_true", default=False)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault", choices=["none", "lr", "nan", "batch"], default="none")
    parser.add_argument("--fault-step", type=int, default=None)
    args = parser.parse_args()
    fault_step = args.fault_step if args.fault_step is not None else int(args.steps * 0.6)

    torch.manual_seed(args.seed)
    features, adj, labels = synthetic_cora()
    n_classes = int(labels.max()) + 1
    idx = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1))
    idx_test, idx_val, idx_train = idx[:100], idx[100:200], idx[200:]
    model = GAT(features.shape[1], args.hidden_dim, args.num_heads, n_classes, args.concat_heads,
                args.dropout_p)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.l2)
    criterion = nn.NLLLoss()
    for epoch in range(args.steps):
        x, target = features, labels
        if args.fault == "lr" and epoch == fault_step:
            for group in optimizer.param_groups:
                group["lr"] *= 100
        if args.fault == "nan" and epoch == fault_step:
            x = features.clone()
            x[int(idx_train[0]), 3] = float("nan")
        if args.fault == "batch" and epoch == fault_step:
            target = labels.clone()
            target[idx_train] = torch.randint(0, n_classes, (len(idx_train),))
        model.train()
        optimizer.zero_grad()
        output = model(x, adj)
        loss = criterion(output[idx_train], target[idx_train])
        loss.backward()
        optimizer.step()
        loss_train, acc_train = test(model, criterion, x, adj, target, idx_train)
        loss_val, acc_val = test(model, criterion, x, adj, target, idx_val)
        if epoch % args.val_every == 0:
            print(f"Epoch {epoch:03d} | Train loss {loss.item():.4f} ({loss_train:.4f}), acc {acc_train:.3f}"
                  f" | Val loss {loss_val:.4f}, acc {acc_val:.3f}", flush=True)
    loss_test, acc_test = test(model, criterion, features, adj, labels, idx_test)
    print(f"Test set results: loss {loss_test:.4f} accuracy {acc_test:.4f}")


if __name__ == "__main__":
    main()
