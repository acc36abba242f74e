"""`python -m engine.tp RANK PLAN`: a rank of a tensor-parallel worker, started by its rank 0
(engine.tp.runner) with the plan as JSON."""

from __future__ import annotations

import json
import sys

from engine.tp.runner import RankPlan, serve_rank


def main() -> None:
    rank, plan = int(sys.argv[1]), RankPlan(**json.loads(sys.argv[2]))
    serve_rank(plan, rank)


if __name__ == "__main__":
    main()
