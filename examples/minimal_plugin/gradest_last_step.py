"""gradest_last_step: the shortest estimator plugin that passes ``gradest check``."""

from gradest.plugin import Definition, EstimatorBase, exact_cotangents


class LastStep(EstimatorBase):
    """The last step's exact term alone, J_{N-1}^T beta_{N-1} a_N: one VJP, biased."""

    def _terminal(self, ctx):
        k = ctx.num_steps - 1
        beta = ctx.host_coefficients[1][k]  # host floats: no sync with the device
        cotangent = beta * ctx.terminal_adjoint()
        state = ctx.trajectory().states[k : k + 1]
        grads = ctx.field.param_vjp(state, [ctx.host_times[k]], cotangent[None])
        return grads, None  # (parameter gradients, no noise gradient)

    def definition(self, chain, objective, decisions):
        last = chain.num_steps - 1
        return Definition(grad=chain.gradient(exact_cotangents(chain, objective), [last]))
