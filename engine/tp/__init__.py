"""Tensor parallelism on one host: a worker whose model is split over `model.tp` processes.

The worker's own process is rank 0: it schedules, talks to the gateway and moves KV as any
worker does, and computes its share of every step. Ranks 1.. are processes it starts
(`python -m engine.tp`), which only compute. Each rank holds its share of the attention heads
(q, k, v rows; o columns) and of the MLP's columns (gate, up rows; down columns); the
embedding, norms and output head are whole on every rank. After the attention and after the
MLP, the ranks sum their partial outputs (an all-reduce, over gloo on loopback).

The KV cache is one file in shared memory that every rank maps: each rank writes and reads its
own heads of it, and rank 0 sees them all. So KV moves between workers exactly as it does for
one process, whole heads per token, and a worker of any `tp` exchanges KV with one of any
other: the heads are re-sliced by where each rank reads them.

Rank 0 sends each step's batch to the other ranks (a broadcast); they run the same forward
pass. A rank that dies ends its worker (its requests resume elsewhere, as for any worker
lost); the ranks die with their worker.
"""
