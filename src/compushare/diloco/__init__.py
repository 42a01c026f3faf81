"""DiLoCo training across peers (issue 42): each participant runs H inner AdamW steps from
the shared outer weights, the participants average their pseudo-gradients, and an outer
Nesterov SGD step makes the next outer weights.

  recipe.py   pure: the run's recipe (model shape, corpus digest, inner/outer settings) and its checked wire form
  corpus.py   pure: the byte-level corpus, its train/eval split, and the public-seed minibatch sampler
  inner.py    the model, one participant's round of inner steps, the outer optimizer, eval, the one-process baseline
"""
