"""``polyaccel train``: the main job (launcher, model, data, training loop, summary).

The command module is :mod:`polyaccel.apps.train.command`, registered in the entry-point
group ``polyaccel.commands``. Nothing heavy is imported here.
"""
