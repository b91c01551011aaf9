"""Ray's DAG API: f.bind, Actor.bind, actor.method.bind, InputNode (whole, by index, by
key and attribute), MultiOutputNode, execute returning refs (and actor handles), shared
nodes running once, and the errors of misuse."""

import warnings

import ray
from ray.dag import ClassMethodNode, ClassNode, DAGNode, FunctionNode, InputNode, MultiOutputNode

warnings.simplefilter("ignore")  # Ray: DAGNode.execute() is deprecated
ray.init(num_cpus=4)


@ray.remote
def add(a, b):
    return a + b


@ray.remote
def mul(a, b):
    return a * b


@ray.remote
def total(values):
    # Nodes nested in an argument arrive as refs (as refs nested in values do).
    kinds = sorted({type(v).__name__ for v in values})
    return kinds, sum(ray.get(v) if isinstance(v, ray.ObjectRef) else v for v in values)


@ray.remote(num_returns=2)
def split(x):
    return x, -x


@ray.remote
class Counter:
    def __init__(self, start):
        self.value = start

    def incr(self, by):
        self.value += by
        return self.value

    def get(self):
        return self.value


# A plain graph: no input.
dag = add.bind(mul.bind(2, 3), 4)
print("types", type(dag).__name__, isinstance(dag, DAGNode), isinstance(dag, FunctionNode))
ref = dag.execute()
print("execute gives a ref", isinstance(ref, ray.ObjectRef), ray.get(ref))

# One input value, used twice.
with InputNode() as inp:
    dag = add.bind(mul.bind(inp, inp), inp)
print("x*x + x", [ray.get(dag.execute(x)) for x in (1, 2, 3)])

# Several inputs by index, keywords by key and by attribute.
with InputNode() as inp:
    dag = add.bind(inp[0], mul.bind(inp[1], inp.scale))
print("inp[0] + inp[1] * inp.scale", ray.get(dag.execute(1, 2, scale=10)))
with InputNode() as inp:
    dag = add.bind(inp["a"], inp["b"])
print("dict input", ray.get(dag.execute({"a": 5, "b": 6})))
with InputNode() as inp:
    dag = add.bind(inp[0], inp[1])
print("list input", ray.get(dag.execute([7, 8])))

# Nodes nested in a list argument.
with InputNode() as inp:
    dag = total.bind([add.bind(inp, 1), add.bind(inp, 2), 100])
print("nested in a list", ray.get(dag.execute(10)))

# Several outputs.
with InputNode() as inp:
    dag = MultiOutputNode([add.bind(inp, 1), mul.bind(inp, 2), split.bind(inp)])
out = dag.execute(5)
print("MultiOutputNode", type(out).__name__, len(out), ray.get(out[0]), ray.get(out[1]), ray.get(out[2]))

# num_returns=2 gives two refs.
refs = split.bind(3).execute()
print("num_returns=2", type(refs).__name__, ray.get(refs))

# options on the bound function.
print("options", ray.get(add.options(num_cpus=0.5).bind(1, 1).execute()))

# An actor in the graph: methods bound in order run in order, on one actor per execute.
with InputNode() as inp:
    counter = Counter.bind(100)
    first = counter.incr.bind(inp)
    second = counter.incr.bind(inp)
    dag = MultiOutputNode([first, second, counter.get.bind()])
print("class nodes", type(counter).__name__, isinstance(counter, ClassNode), isinstance(first, ClassMethodNode))
print("actor graph", ray.get(dag.execute(1)), ray.get(dag.execute(10)))
handle = Counter.bind(7).execute()
print("a class node executes to a handle", type(handle).__name__, ray.get(handle.get.remote()))

# Methods of a live actor bind too.
live = Counter.remote(0)
with InputNode() as inp:
    dag = live.incr.bind(add.bind(inp, 1))
print("live actor", ray.get(dag.execute(1)), ray.get(dag.execute(1)), ray.get(live.get.remote()))

# A node used by two others runs once per execution.
c = Counter.remote(0)
with InputNode() as inp:
    once = c.incr.bind(inp)
    dag = MultiOutputNode([add.bind(once, 0), add.bind(once, 0)])
print("shared node once", ray.get(dag.execute(1)), ray.get(c.get.remote()))

# Misuse.
for what, call in [
    ("bind on a node", lambda: add.bind(1, 2).bind(3)),
    ("remote on a node", lambda: add.bind(1, 2).remote()),
    ("remote on a class method node", lambda: Counter.bind(1).incr.remote(1)),
    ("InputNode with args", lambda: InputNode(1)),
    ("MultiOutputNode of a node", lambda: MultiOutputNode(add.bind(1, 2))),
]:
    try:
        call()
        print(what, "no error")
    except (AttributeError, ValueError) as e:
        print(what, type(e).__name__)
with InputNode() as inp:
    try:
        Counter.bind(inp)
    except ValueError:
        print("InputNode in a constructor ValueError")
outside = InputNode()
try:
    add.bind(outside, 1).execute(1)
except AssertionError:
    print("InputNode outside a with block AssertionError")
with InputNode() as a, InputNode() as b:
    try:
        add.bind(a, b).execute(1)
    except AssertionError:
        print("two InputNodes AssertionError")

# A failing task raises at get, as a ref's would.
@ray.remote
def boom(x):
    raise ValueError(f"boom {x}")


with InputNode() as inp:
    dag = add.bind(boom.bind(inp), 1)
try:
    ray.get(dag.execute(4))
except ValueError as e:
    print("error through the graph", type(e).__name__, isinstance(e, ray.exceptions.RayTaskError))
ray.shutdown()
