"""Many workers, one version: worker shares built side by side (:mod:`.worker`, launched by Slurm or
torchrun: :mod:`.launchers`, or as Ray tasks: :mod:`.ray`), then merged into one build (:mod:`.merge`).
Which parts a share holds, and its record, are :mod:`hs_dataset.write.shares`."""
