"""Small, complete models that implement the model protocol (`degs_jax.model_api`), for
the documentation, the notebooks and the tests. The library never imports them."""
