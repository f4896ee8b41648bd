"""A round's trainer as a Kubernetes job: the pod both job kinds share, the TrainJob (Kubeflow Trainer v2,
the default) and the PyTorchJob (Training Operator v1), and the train step that launches them."""
