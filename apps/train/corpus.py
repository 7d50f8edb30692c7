"""The small text that ``polyaccel train`` learns from when no ``--text`` file is given.

Written for this project (about 4 KB of plain English about training on many kinds of
hardware). It is tiny on purpose: a byte-level model sees the loss fall within a few dozen
steps, which is what the main job is meant to show.
"""

TEXT = """\
A training run is a conversation between a model, a pile of text and a machine. The model
guesses the next letter, the text says what the letter really was, and the machine does the
arithmetic that nudges every weight a little closer to a better guess. Repeat that a few
thousand times and the guesses stop being noise: first the model learns that spaces follow
words, then that words are spelled the same way each time, and at last that some words like
to sit next to each other.

The machine is the part that changes most. One lab trains on graphics cards, another on a
chip made for matrix arithmetic, a third on whatever cores are free at night. The arithmetic
is the same everywhere; what differs is how memory is reserved, how two devices talk to each
other, which kernels are fast and which features exist at all. A good platform keeps those
differences in one place, behind a small contract, so that the training loop never has to ask
which vendor built the chip under it.

Sharding is how a run grows past the memory of a single device. The optimizer keeps two extra
numbers for every weight, and a full copy of the weights in high precision, so it needs far
more memory than the model itself. Split that state over the ranks and each one holds only its
share. Split the gradients too, and each rank only keeps the slice it will update. Split the
weights as well, and a rank gathers a layer just before it runs and lets it go right after.
Every split trades memory for messages: a reduce scatter here, an all gather there.

Messages are the price of company. When two ranks agree on a gradient they must wait for the
slower one, so a careful engine sends its buckets while the backward pass is still running and
hides the wait behind useful work. On a machine without streams there is nothing to overlap
with, and the engine says so instead of pretending.

Checkpoints are promises to the future. A run that stops at step five hundred should start
again at step five hundred and one as if nothing happened: the same weights, the same moments
in the optimizer, the same next batch of text. A checkpoint written halfway when the power
fails must not replace the last good one, so the files are written under temporary names and
renamed only when they are complete, and the pointer to the newest checkpoint is written last.

Small models are honest teachers. A network with a few hundred thousand weights, reading a
few pages of text one byte at a time, will not write poetry, but it shows every moving part:
the launcher that starts the ranks, the group that lets them talk, the engine that shards and
gathers, the optimizer kernel chosen for the device, the progress bar that counts tokens per
second, and the summary that names who did the work. When each of those parts behaves, a
larger model is only a matter of patience and hardware.

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump. Sphinx of black quartz, judge my vow. The five boxing wizards
jump quickly. Numbers are text too: one, two, three, four, five, six, seven, eight, nine, ten;
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20.

A loss that goes down is the first good sign. A loss that goes down the same way twice, on
two machines of different makers, is the second. A loss that goes down the same way after a
restart is the third, and the one that lets people sleep while their jobs run.
"""
