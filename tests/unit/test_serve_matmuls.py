"""A stage's products in the form measured cheapest: the plan from the timings, and the same numbers either way."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from raycluster_cli.serve.matmuls import Matmuls, measure, plan_from_costs  # noqa: E402


def test_the_plan_takes_the_cheapest_form_and_row_count_that_clearly_beats_f_linear() -> None:
    # (F.linear, W @ xT) seconds by row count, shaped like the lab CPU's float32 figures
    costs = {1: (1.14, 1.11), 2: (1.70, 0.74), 3: (1.88, 1.05), 4: (1.60, 1.54), 5: (1.69, 1.58), 6: (1.80, 1.80)}
    plan = plan_from_costs(costs)
    assert plan[1] == (True, 2)  # one row is cheapest as two (a zero row added) in the second form
    assert plan[2] == (True, 2) and plan[3] == (True, 3)
    # 1.54 against 1.60 is under the 10 % a form must win by; 3 rows' 1.05 cannot carry 4 or 5 rows
    assert set(plan) == {1, 2, 3}
    assert plan_from_costs({1: (1.0, 1.05), 2: (1.5, 1.6)}) == {}  # F.linear everywhere (bfloat16 here)


def test_any_form_gives_each_row_its_own_product_with_bias_and_any_leading_shape() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True)
    for rows in (1, 2, 3):
        x = torch.randn(rows, 1, 64)
        want = linear(x)
        for how in ((True, rows), (True, 4), (False, 4)):
            got = Matmuls({rows: how}).apply(linear, x)
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert Matmuls({2: (False, 2)}).plan == {}  # F.linear at its own rows is not a plan entry


def test_measure_on_real_matrices_plans_only_steps_of_few_rows_and_keeps_their_numbers() -> None:
    torch.manual_seed(1)
    linears = [nn.Linear(256, 512, bias=False), nn.Linear(512, 256, bias=False)]
    mm = measure(linears, most_rows=4, budget_s=5.0)
    assert set(mm.plan) <= {1, 2, 3, 4}
    for rows, (_, padded) in mm.plan.items():
        assert rows <= padded <= 4
    x = torch.randn(3, 256)
    torch.testing.assert_close(mm.apply(linears[0], x), linears[0](x), rtol=1e-5, atol=1e-5)
    assert measure([], most_rows=2).plan == {}
