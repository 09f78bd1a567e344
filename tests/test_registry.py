"""The published model as an MLflow pyfunc model (`alignpipe.registry`), saved and loaded the way MLflow users do."""

from __future__ import annotations

import logging
import warnings

import pandas as pd


def test_a_saved_pyfunc_model_warns_of_nothing_and_loads_by_code(tiny, tmp_path, caplog):
    """Saving runs no pickling of the model class (MLflow's "models from code"), a typed `predict` and an input
    example leave MLflow nothing to warn about, and the saved folder loads and answers lists and DataFrames alike."""
    import mlflow.pyfunc

    from alignpipe.registry import INPUT_EXAMPLE, save_pyfunc

    mlflow_log = logging.getLogger("mlflow")  # it does not propagate to the root logger caplog listens on
    mlflow_log.addHandler(caplog.handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dest = save_pyfunc(tiny / "model", tmp_path / "pyfunc")
            model = mlflow.pyfunc.load_model(str(dest))
    finally:
        mlflow_log.removeHandler(caplog.handler)
    assert not [w for w in caught if "mlflow" in w.filename], [str(w.message)[:120] for w in caught]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage()[:120] for r in caplog.records
    ]
    assert (dest / "pyfunc_model.py").is_file() and not list(dest.glob("*.pkl"))
    assert (dest / "input_example.json").is_file()
    params = {"max_new_tokens": 6}
    one = model.predict(INPUT_EXAMPLE, params=params)
    assert len(one) == 1 and isinstance(one[0], str)
    assert model.predict(pd.DataFrame({"prompt": INPUT_EXAMPLE * 2}), params=params) == one * 2
