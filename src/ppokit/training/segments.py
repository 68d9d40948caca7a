"""Episodes of several rows: an agent episode whose calls made several segments trains each segment as a row of its
own (`episodes.with_segment_rows`), while its reward, its group and its advantage stay the episode's. Pure tensor
functions between the two layouts:

    rows      (B, R)  the training rows, several per episode: what the forwards and the loss read
    episodes  (E, T)  each episode's trained tokens in call order, from column 0: what the estimators read

`episode_layout` says where each episode token comes from; `gather` moves a per-token tensor from the rows to the
episodes, `scatter` back. Any estimator then runs on the episodes as it does on one-row episodes: GRPO / RLOO / ReMax
groups stay n episodes per data row, a discounted return runs across the episode's segments, and GAE bootstraps the
end of an earlier segment from the value at the next segment's first trained token (a gap between two segments is
one more observation: `algo.gae` skips the tokens outside the mask). `rows_of`, `episode_chunks` and `row_shares`
keep an episode's rows together in the optimisation and its weight that of one episode.

Imports torch only.
"""

from __future__ import annotations

import torch


def episode_layout(mask: torch.Tensor, episode: torch.Tensor, rank: torch.Tensor, episodes: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each token of the episode layout comes from.

    mask: (B, R) bool, the tokens carried (the trained tokens); episode: (B,) long, each row's episode in [0, E);
    rank: (B,) long, the row's place among its episode's rows (any increasing key: call order); episodes: E
    -> (row (E, T) long, column (E, T) long, real (E, T) bool), T the most tokens of an episode (at least 1): episode
    e's t-th token (its rows in rank order, each row's masked tokens left to right) is mask's (row[e, t], column[e, t]);
    real False (row = column = 0) after an episode's last token.
    """
    rows, width = mask.shape
    device = mask.device
    key = episode.long() * (int(rank.max()) + 1 if rows else 1) + rank.long()
    order = torch.sort(key, stable=True).indices  # rows grouped by episode, in rank order within each
    flat = mask[order].reshape(-1).nonzero().squeeze(1)  # the carried tokens in (episode, rank, column) order
    source_row = order[flat // width] if width else flat
    source_column = flat % width if width else flat
    owner = episode.long()[source_row]
    counts = torch.bincount(owner, minlength=episodes)
    length = max(int(counts.max()) if counts.numel() else 0, 1)
    start = torch.cumsum(counts, 0) - counts
    position = torch.arange(len(flat), device=device) - start[owner]
    row = torch.zeros((episodes, length), dtype=torch.long, device=device)
    column = torch.zeros((episodes, length), dtype=torch.long, device=device)
    real = torch.zeros((episodes, length), dtype=torch.bool, device=device)
    row[owner, position], column[owner, position], real[owner, position] = source_row, source_column, True
    return row, column, real


def gather(values: torch.Tensor, row: torch.Tensor, column: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """(B, R) per-token values of the rows -> (E, T) in the episode layout (`episode_layout`), 0 where not real."""
    return values[row, column] * real.to(values.dtype)


def scatter(values: torch.Tensor, row: torch.Tensor, column: torch.Tensor, real: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """(E, T) per-token values of the episode layout -> (B, R) = `shape` in the rows' layout, 0 on every token the
    layout does not carry (the inverse of `gather` on the carried tokens)."""
    out = torch.zeros(shape, dtype=values.dtype, device=values.device)
    out[row[real], column[real]] = values[real]
    return out


def rows_of(chosen: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """The rows of episodes `chosen` ((k,) long) -> (n,) long row indices: chosen[0]'s rows (ascending), then
    chosen[1]'s, ...; episode: (B,) long, each row's episode."""
    match = episode.unsqueeze(0) == chosen.unsqueeze(1)  # (k, B)
    return match.nonzero()[:, 1]


def episode_chunks(rows: torch.Tensor, episode: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`rows` ((n,) long, each episode's rows adjacent: `rows_of`) in consecutive chunks of `size` episodes each (the
    last may hold fewer): the same number of chunks as `size` rows would make of one row per episode."""
    if rows.numel() == 0:
        return []
    owner = episode[rows]
    new = torch.ones_like(owner, dtype=torch.bool)
    new[1:] = owner[1:] != owner[:-1]
    chunk = (torch.cumsum(new.long(), 0) - 1) // size
    return list(rows.split(torch.bincount(chunk).tolist()))


def row_shares(mask: torch.Tensor, episode: torch.Tensor) -> torch.Tensor:
    """(B, R) bool trained tokens, (B,) long episodes -> (B,) float32: each row's share of its episode's trained tokens
    (1 for an episode of one row with any, 0 for a row without): summed over an episode's rows, 1 (or 0 for an
    episode without trained tokens)."""
    tokens = mask.float().sum(1)
    per_episode = torch.zeros(int(episode.max()) + 1 if episode.numel() else 0, dtype=tokens.dtype, device=tokens.device)
    per_episode.index_add_(0, episode.long(), tokens)
    return tokens / per_episode[episode.long()].clamp(min=1)
