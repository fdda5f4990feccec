"""Ray Tune's side (the driver): the :class:`CoordinatedSearcher`, schedulers fixed where Ray's hang a
sweep, and :class:`PrepService` for Ray Train runs without Tune."""
