"""What MLflow runs to load a published model (MLflow's "models from code"): the pyfunc model is built by this
file at load time, not unpickled from the model folder, so a version loads with any alignpipe that has
`registry.TextGenerator`, and nothing in the folder is a pickle to trust."""

from mlflow.models import set_model

from alignpipe.registry import TextGenerator

set_model(TextGenerator())
