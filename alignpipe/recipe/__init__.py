"""The recipe: one YAML file that declares a whole post-training pipeline."""

from alignpipe.recipe.errors import Problem, RecipeError
from alignpipe.recipe.load import load_recipe, parse_recipe
from alignpipe.recipe.schema import Recipe

__all__ = ["Problem", "Recipe", "RecipeError", "load_recipe", "parse_recipe"]
