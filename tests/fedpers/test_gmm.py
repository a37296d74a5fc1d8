"""FedGMM / FedEM math against scikit-learn's GaussianMixture and by-hand oracles."""

import numpy as np
import pytest
from numpy.testing import assert_allclose
from scipy.special import softmax
from scipy.stats import multivariate_normal
from sklearn.decomposition import PCA
from sklearn.mixture import GaussianMixture

from fedpers import gmm


def _blobs(seed: int, n: int = 600, d: int = 3, offset: float = 0.0) -> np.ndarray:
    generator = np.random.default_rng(seed)
    centres = generator.normal(0, 4, (3, d))
    labels = generator.integers(0, 3, n)
    return centres[labels] + generator.normal(0, 1, (n, d)) + offset


def _start(z: np.ndarray, kind: str) -> tuple[np.ndarray, gmm.Components]:
    means = z[[0, 1, 2]].copy()
    d = z.shape[1]
    covariances = np.stack([np.eye(d)] * 3) if kind == "full" else np.ones((3, d))
    return np.full(3, 1 / 3), gmm.Components(means, covariances)


def _federated_em(
    parts: list[np.ndarray],
    weights: np.ndarray,
    components: gmm.Components,
    *,
    iterations: int,
    ridge: float,
    shared_weights: bool,
) -> tuple[np.ndarray, gmm.Components, list[float]]:
    """Learners fixed (M2 = 1, log P(y|x) = 0); every client runs the E-step and sends
    centred statistics; the server pools them. Personal weights unless shared."""
    personal = [weights.reshape(3, 1).copy() for _ in parts]
    shared = weights.reshape(3, 1)
    log_likelihoods = []
    for _ in range(iterations):
        total: gmm.Statistics | None = None
        gammas, log_likelihood = [], 0.0
        for c, z in enumerate(parts):
            log_w = np.log(shared if shared_weights else personal[c])
            q, log_joint = gmm.e_step(log_w, gmm.log_gaussian(z, components), np.zeros((len(z), 1)))
            log_likelihood += float(log_joint.sum())
            personal[c] = gmm.update_weights(q)
            gammas.append(q.sum(axis=0))
            stats = gmm.sufficient_statistics(z, q.sum(axis=2), components.means, components.kind)
            total = stats if total is None else total + stats
        assert total is not None
        components = gmm.components_from_statistics(total, ridge=ridge, previous=components)
        shared = gmm.global_weights(gammas)
        log_likelihoods.append(log_likelihood)
    result = shared if shared_weights else personal[0]
    return result.ravel(), components, log_likelihoods


def _sklearn(
    z: np.ndarray,
    weights: np.ndarray,
    components: gmm.Components,
    iterations: int,
    ridge: float,
) -> GaussianMixture:
    kind = components.kind
    precisions = (
        np.linalg.inv(components.covariances) if kind == "full" else 1 / components.covariances
    )
    model = GaussianMixture(
        n_components=3,
        covariance_type=kind,
        reg_covar=ridge,
        tol=0.0,
        max_iter=iterations,
        n_init=1,
        weights_init=weights,
        means_init=components.means,
        precisions_init=precisions,
    )
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning: tol = 0 never "converges"
        return model.fit(z)


@pytest.mark.parametrize("kind", ["full", "diag"])
@pytest.mark.parametrize("offset", [0.0, 1e4])
def test_one_client_equals_sklearn_em(kind: str, offset: float) -> None:
    z = _blobs(0, offset=offset)
    weights, start = _start(z, kind)
    ours_w, ours, log_likelihoods = _federated_em(
        [z], weights, start, iterations=25, ridge=1e-6, shared_weights=False
    )
    oracle = _sklearn(z, weights, start, 25, 1e-6)
    assert_allclose(ours_w, oracle.weights_, atol=1e-6)
    assert_allclose(ours.means, oracle.means_, rtol=1e-9, atol=1e-6)
    assert_allclose(ours.covariances, oracle.covariances_, atol=1e-6)
    assert np.all(np.diff(log_likelihoods) >= -1e-9 * abs(log_likelihoods[0]))  # EM ascent


def test_clients_holding_copies_equal_sklearn_em_with_personal_weights() -> None:
    z = _blobs(1)
    weights, start = _start(z, "full")
    ours_w, ours, _ = _federated_em(
        [z, z.copy(), z.copy()],
        weights,
        start,
        iterations=15,
        ridge=1e-6,
        shared_weights=False,
    )
    oracle = _sklearn(z, weights, start, 15, 1e-6)
    assert_allclose(ours_w, oracle.weights_, atol=1e-6)
    assert_allclose(ours.covariances, oracle.covariances_, atol=1e-6)


def test_random_iid_split_with_shared_weights_equals_sklearn_em() -> None:
    z = _blobs(2, n=900)
    parts = np.array_split(np.random.default_rng(3).permutation(z), 5)
    weights, start = _start(z, "full")
    ours_w, ours, log_likelihoods = _federated_em(
        parts, weights, start, iterations=20, ridge=1e-6, shared_weights=True
    )
    oracle = _sklearn(z, weights, start, 20, 1e-6)
    assert_allclose(ours_w, oracle.weights_, atol=1e-6)
    assert_allclose(ours.means, oracle.means_, atol=1e-6)
    assert_allclose(ours.covariances, oracle.covariances_, atol=1e-6)
    assert np.all(np.diff(log_likelihoods) >= -1e-9)


def test_paper_averaging_drops_the_between_client_term() -> None:
    generator = np.random.default_rng(4)
    a, b = generator.normal(-2, 1, (500, 1)), generator.normal(2, 1, (500, 1))
    center = np.zeros((1, 1))
    stats = [gmm.sufficient_statistics(x, np.ones((len(x), 1)), center, "full") for x in (a, b)]
    exact = gmm.components_from_statistics(stats[0] + stats[1], ridge=0.0)
    local = [gmm.components_from_statistics(s, ridge=0.0) for s in stats]
    averaged = gmm.average_components(local, np.array([[500.0], [500.0]]), previous=exact)
    pooled = np.concatenate([a, b])
    assert exact.covariances[0, 0, 0] == pytest.approx(pooled.var(), rel=1e-12)
    between = np.var([a.mean(), b.mean()])
    assert averaged.covariances[0, 0, 0] == pytest.approx(pooled.var() - between, rel=1e-9)


@pytest.mark.parametrize("kind", ["full", "diag"])
def test_log_gaussian_matches_scipy(kind: str) -> None:
    generator = np.random.default_rng(5)
    z = generator.normal(size=(20, 4))
    root = generator.normal(size=(2, 4, 4))
    full = root @ root.transpose(0, 2, 1) + np.eye(4)
    covariances = full if kind == "full" else np.stack([np.diag(c) for c in full])
    components = gmm.Components(generator.normal(size=(2, 4)), covariances)
    ours = gmm.log_gaussian(z, components)
    for k in range(2):
        cov = full[k] if kind == "full" else np.diag(covariances[k])
        assert_allclose(
            ours[:, k], multivariate_normal(components.means[k], cov).logpdf(z), atol=1e-10
        )


def test_e_step_is_the_normalized_product_and_stable_in_log_space() -> None:
    generator = np.random.default_rng(6)
    log_w = np.log(generator.dirichlet(np.ones(6)).reshape(2, 3))
    log_gauss = generator.normal(-800, 5, (10, 2))  # exp underflows to 0 in float64
    log_lik = np.log(generator.uniform(0.01, 1, (10, 3)))
    q, log_joint = gmm.e_step(log_w, log_gauss, log_lik)
    assert np.all(np.isfinite(q))
    assert np.all(np.isfinite(log_joint))
    assert_allclose(q.sum(axis=(1, 2)), 1.0)
    shifted = log_gauss + 800  # oracle: the same product without underflow
    product = np.exp(log_w)[None] * np.exp(shifted)[:, :, None] * np.exp(log_lik)[:, None, :]
    assert_allclose(q, product / product.sum(axis=(1, 2), keepdims=True), atol=1e-12)
    assert_allclose(log_joint, np.log(product.sum(axis=(1, 2))) - 800, atol=1e-9)


def test_weights_are_clamped_and_renormalized() -> None:
    q = np.zeros((4, 2, 2))
    q[:, 0, 0] = 1.0
    weights = gmm.update_weights(q)
    assert weights.min() >= gmm.WEIGHT_FLOOR / (1 + 3 * gmm.WEIGHT_FLOOR)
    assert weights.sum() == pytest.approx(1.0)
    assert np.all(np.isfinite(np.log(weights)))


def test_prediction_mixes_learners_by_their_posterior() -> None:
    generator = np.random.default_rng(7)
    log_w = np.log(generator.dirichlet(np.ones(4)).reshape(2, 2))
    log_gauss = generator.normal(size=(5, 2))
    learner_probs = softmax(generator.normal(size=(5, 2, 3)), axis=2)
    cells = np.exp(log_w)[None] * np.exp(log_gauss)[:, :, None]
    posterior = cells.sum(axis=1) / cells.sum(axis=(1, 2))[:, None]
    expected = (posterior[:, :, None] * learner_probs).sum(axis=1)
    assert_allclose(gmm.predict_proba(log_w, log_gauss, learner_probs), expected, atol=1e-12)
    marginal = np.log((np.exp(log_w).sum(axis=1)[None] * np.exp(log_gauss)).sum(axis=1))
    assert_allclose(gmm.log_marginal(log_w, log_gauss), marginal, atol=1e-12)


def test_adapting_weights_recovers_a_clients_mixture() -> None:
    generator = np.random.default_rng(8)
    components = gmm.Components(np.array([[-5.0], [0.0], [5.0]]), np.ones((3, 1, 1)))
    truth = np.array([0.7, 0.0, 0.3])
    z = np.concatenate([generator.normal(-5, 1, (700, 1)), generator.normal(5, 1, (300, 1))])
    adapted = gmm.adapt_weights(
        gmm.log_gaussian(z, components),
        np.zeros((len(z), 1)),
        np.full((3, 1), 1 / 3),
        iterations=200,
    )
    assert_allclose(adapted.ravel(), truth, atol=0.01)


def test_weighted_average_is_the_hand_computed_one() -> None:
    arrays = [np.full((2,), 1.0), np.full((2,), 4.0)]
    assert_allclose(gmm.weighted_average(arrays, np.array([3.0, 1.0])), 1.75)
    with pytest.raises(ValueError, match="positive sum"):
        gmm.weighted_average(arrays, np.zeros(2))


def test_pooled_pca_equals_sklearn_pca_on_all_data() -> None:
    generator = np.random.default_rng(9)
    x = generator.normal(size=(300, 6)) @ generator.normal(size=(6, 6))
    parts = np.array_split(x, 4)
    moments = [gmm.moment_statistics(p) for p in parts]
    mean, directions = gmm.pca_from_moments(
        sum(m[0] for m in moments),
        sum(m[1] for m in moments),
        sum(m[2] for m in moments),
        3,
    )
    oracle = PCA(n_components=3).fit(x)
    assert_allclose(mean, oracle.mean_, atol=1e-10)
    assert_allclose(np.abs(directions @ oracle.components_.T), np.eye(3), atol=1e-8)


def test_federated_kmeans_init_finds_separated_centres() -> None:
    generator = np.random.default_rng(10)
    centres = np.array([[-10.0, 0.0], [0.0, 10.0], [10.0, 0.0]])
    summaries = []
    for c in range(6):
        held = generator.choice(3, 2, replace=False)  # each client sees two centres
        z = np.concatenate([centres[h] + generator.normal(0, 0.5, (50, 2)) for h in held])
        summaries.append(gmm.local_summary(z, clusters=4, seed=c))
    means = gmm.initial_means(
        np.concatenate([s[0] for s in summaries]),
        np.concatenate([s[1] for s in summaries]),
        3,
        seed=0,
    )
    distances = np.linalg.norm(means[:, None] - centres[None], axis=2)
    assert np.all(distances.min(axis=0) < 1.0)
