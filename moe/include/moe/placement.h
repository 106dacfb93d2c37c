// Load-driven expert placement (placement.mode = replicate): which expert each
// expert slot of each rank of an expert-parallel group holds, and which
// replica serves the tokens a source rank sends to an expert. Plain data: the
// table is computed from a load vector, identically on every rank.
#ifndef MOE_PLACEMENT_H
#define MOE_PLACEMENT_H

#include <stdbool.h>
#include <stddef.h>

// Rank r's slots 0 .. El-1 hold its El home experts (El = E / P): the
// primaries, which keep the optimizer state and are the only copies
// checkpoints see. They start as today's contiguous blocks r*El .. r*El+El-1
// and move only under `moves` (placement.mode = move), by swaps, so every
// rank keeps El homes. Slots El .. S-1 are spare and hold replicas of hot
// experts (-1: empty). Static placement: contiguous homes, no replica.
typedef struct {
    int E, P, S, El; // experts, ranks, slots per rank, home experts per rank
    bool moves;      // moe_placement_update may swap home experts between ranks
    int *slot;       // [P * S] expert held by slot j of rank r, -1 empty
    int *n_hold;     // [E] ranks holding expert e (1 + replicas)
    int *hold;       // [E * P] those ranks, the home rank first, then by slot order
} moe_placement;

// Static table for E experts over P ranks with S >= E / P slots each.
int moe_placement_init(moe_placement *t, int E, int P, int S);
void moe_placement_free(moe_placement *t);
// True when no spare slot holds a replica and the homes are the contiguous
// blocks (today's placement).
bool moe_placement_is_static(const moe_placement *t);
// Home rank of expert e.
static inline int moe_placement_home(const moe_placement *t, int e) {
    return t->hold[(size_t)e * t->P];
}

// Recomputes the table from load [E] (rows each expert computes, any
// scale, e.g. the globally reduced EMA; identical inputs and the same
// current homes give identical tables). Replicas are dropped and homes kept;
// with moves, homes are first swapped greedily: while some swap of an expert
// of the rank with the largest home load (ties: lower rank) with one of
// another rank lowers both ranks' home loads below that maximum, the one
// giving the lowest new maximum is made (ties: lower slots and ranks; each
// swap lowers the sum of squared rank loads, so this ends). Then the expert with the highest load
// per holder (ties: lower index) gets a replica in a free spare slot of the least loaded rank that
// lacks it (ties: lower rank), as long as that lowers the largest rank load
// of moe_placement_rank_tokens; the first replica that does not is undone
// and the update stops (balanced load: no replica at all).
int moe_placement_update(moe_placement *t, const double *load);

// Rank that computes the tokens source rank s routes to expert e: s itself
// when it holds e (no exchange), else the non-holders, in rank order, are
// dealt round-robin over e's holders (home first). Deterministic.
int moe_placement_dest(const moe_placement *t, int e, int s);
// Slot of rank r holding expert e, -1 when none.
int moe_placement_slot_of(const moe_placement *t, int r, int e);

// Capacity follows replicas: with per-expert capacity c (rows one source rank
// keeps for an expert, so a lone expert computes at most P * c rows), each
// holder of e has that budget P * c, split among the sources the deal sends
// to it: floor(P c / m) each, the first (P c mod m) in rank order one more.
// Returns source s's capacity for e; c itself when e has one holder, so a
// table without replicas changes nothing. Never below c.
int moe_placement_capacity(const moe_placement *t, int e, int s, int c);

// The model behind `moe plan`: tokens each rank computes when every source
// rank routes load[e] / P tokens to expert e; rank_tokens [P].
void moe_placement_rank_tokens(const moe_placement *t, const double *load, double *rank_tokens);

// One MoE layer's placement as the layer's dispatch sees it (acts->place, set
// by the trainer; NULL or inactive: today's exchange, bit for bit). Replica
// slot El + i keeps its weights and gradient at i * expert_numel of rep_w and
// rep_g; the rest is the dispatch's scratch, sized for the layer.
typedef struct moe_place_layer {
    moe_placement t;
    bool active;          // some spare slot holds a replica
    size_t numel;         // floats of one expert (3 H D)
    float *rep_w, *rep_g; // [(S - El) * numel]
    float *xs;            // [rows_max * D] token-side rows in send order
    int *seg, *cnt;       // [P * S] first row in expert order and rows sent, per (dest, slot)
    int *recv_kept, *blk_off, *blk_n; // [P * S] per (source, slot) on the expert side
    int *send_rows, *recv_rows;       // [P]
    int *cap;                         // [E] this source's capacities (moe_placement_capacity)
} moe_place_layer;

// Allocates pl for a layer of E experts of numel floats each, rows_max
// token-side rows of D floats, over P ranks with S slots each; static table.
int moe_place_layer_init(moe_place_layer *pl, int E, int P, int S, size_t numel, size_t rows_max,
                         int D);
void moe_place_layer_free(moe_place_layer *pl);

#endif
