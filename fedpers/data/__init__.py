"""Data sets, partitioners and the per-client view of them.

- ``registry``: static facts about each data set (classes, input shape, default model).
- ``sources``: whole data sets as arrays (MNIST-1D, digits, torchvision from a root).
- ``partition``: splits over clients (S classes, Dirichlet, log-normal sizes).
- ``synthetic``: the linear regression tasks of FedRep's Section 4.
- ``client``: one client's train/test data, cached per process.
"""
