"""DecodeState.apply_delta against a plain-Python model of what a StepDelta means: compaction
first (new row i takes old row row_map[i], every later row the inert row's values), then the
joining rows' numbers, then the block-table entries."""
import random

import torch

from graphexec.capture.state import MAX_STOP_IDS, DecodeState, pack_delta
from graphexec.plan import NewRow, StepDelta

FIELDS = ("input_ids", "positions", "steps", "seeds", "min_tokens", "top_k", "temperature",
          "top_p", "stop_ids", "block_tables")


def _snapshot(st: DecodeState) -> dict:
    return {f: getattr(st, f).tolist() for f in FIELDS}


def _expected(before: dict, delta: StepDelta, max_rows: int) -> dict:
    out = {f: [list(v) if isinstance(v, list) else v for v in rows]
           for f, rows in before.items()}
    if delta.row_map is not None:
        gather = list(delta.row_map) + [max_rows] * (max_rows + 1 - len(delta.row_map))
        out = {f: [list(rows[g]) if isinstance(rows[g], list) else rows[g] for g in gather]
               for f, rows in out.items()}
    for r in delta.new_rows:
        out["seeds"][r.row], out["min_tokens"][r.row], out["top_k"][r.row] = (
            r.seed, r.min_tokens, r.top_k)
        out["input_ids"][r.row], out["positions"][r.row], out["steps"][r.row] = (
            r.input_id, r.position, r.step)
        out["stop_ids"][r.row] = r.stop_ids + [-1] * (MAX_STOP_IDS - len(r.stop_ids))
        out["temperature"][r.row] = torch.tensor(r.temperature, dtype=torch.float32).item()
        out["top_p"][r.row] = torch.tensor(r.top_p, dtype=torch.float32).item()
    for row, col, block in delta.block_entries:
        out["block_tables"][row][col] = block
    return out


def test_apply_delta_does_what_the_delta_says():
    rows, cols = 9, 6
    st = DecodeState(rows, cols - 1, 100, 99, torch.device("cpu"))
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, rows)
        row_map = rng.sample(range(rows + 1), n) if rng.random() < 0.6 else None
        new_rows = [NewRow(row=r, temperature=rng.random(), top_k=rng.randint(-1, 50),
                           top_p=rng.random(), seed=rng.randint(0, 2**40),
                           min_tokens=rng.randint(0, 5),
                           stop_ids=rng.sample(range(100), rng.randint(0, MAX_STOP_IDS)),
                           input_id=rng.randint(0, 99), position=rng.randint(0, 50),
                           step=rng.randint(0, 9))
                    for r in rng.sample(range(rows), rng.randint(0, 3))]
        entries = [(rng.randrange(rows), rng.randrange(cols), rng.randrange(99))
                   for _ in range(rng.randint(0, 6))]
        delta = StepDelta(num_rows=n, row_map=row_map, new_rows=new_rows,
                          block_entries=entries)
        # the iteration's kernels write these between deltas
        for name in ("input_ids", "positions", "steps"):
            getattr(st, name).copy_(torch.randint(0, 1000, (rows + 1,)))
        want = _expected(_snapshot(st), delta, rows)
        ints, floats = pack_delta(delta, rows)
        st.apply_delta(delta, torch.tensor(ints), torch.tensor(floats, dtype=torch.float32))
        assert _snapshot(st) == want
        assert st.num_rows.item() == n


def test_row_fields_are_contiguous_and_aligned():
    """Kernels take each field's pointer as a plain 1-D array."""
    st = DecodeState(64, 16, 100, 99, torch.device("cpu"))
    for name in FIELDS[:8]:
        t = getattr(st, name)
        assert t.shape == (65,) and t.is_contiguous() and t.data_ptr() % 16 == 0, name
    assert torch.equal(st.top_p, torch.ones(65)) and torch.equal(st.temperature, torch.zeros(65))
