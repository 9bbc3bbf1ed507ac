"""Lightning glue: what connects the strategy to Lightning's Trainer, loops and hooks (the setup batch, how steps
run, precision plugins, checkpoint hooks, the model summary). Import from the modules: this package imports none
of them."""
