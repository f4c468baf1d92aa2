"""The models: the drafter catalog (:mod:`.catalog`), what every drafter's heads share (:mod:`.heads_base`), the
speculative model that holds a target and a drafter (:mod:`.speculative`), the target's named features
(:mod:`.features`), the tree drafter protocol (:mod:`.tree_drafter`) and batched greedy generation
(:mod:`.generation`)."""
