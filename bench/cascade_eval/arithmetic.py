"""An arithmetic verifier for GSM8K answers: are the answer's own calculations right?

It reads only the answer text: GSM8K's calculator annotations ``<<48/2=24>>`` and inline
claims like ``16 - 3 - 4 = 9`` or ``9 * $2 = $18``, evaluates each left side exactly (``+ - *
/`` and parentheses on numbers, nothing else), and scores the share of claims that hold (1.0
when there is nothing to check). It never sees whether the answer is correct — only whether
the answer contradicts itself — so using it as a judge leaks no label.

``verifier_app`` serves it as the HTTP verifier a cascade's ``verifier`` judge calls:
``POST /verify {prompt, response}`` -> ``{accept: score == 1, score}``.
"""
from __future__ import annotations

import ast
import math
import operator
import re

from aiohttp import web

_NUM = r"\$?-?\d[\d,]*(?:\.\d+)?%?"
_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
# A whole chain "a op b ... = c": not starting inside a longer expression, and c not itself the
# start of one ("= 500 - 2 = 498" checks only "500 - 2 = 498").
_INLINE = re.compile(r"(?<![\w.,)*/+\-×÷(])(?<![*/+\-×÷(] )"
                     r"((?:" + _NUM + r")(?:\s*[-+*/x×÷]\s*\(?(?:" + _NUM + r")\)?)+)"
                     r"\s*=\s*\$?(-?\d[\d,]*(?:\.\d+)?)(?![\d,.]*\s*[-+*/x×÷(\d])")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
MAX_EXPRESSION_CHARS = 200


def evaluate(expression: str) -> float | None:
    """The value of an arithmetic expression on numbers, or None when it is not one."""
    text = expression.replace("$", "").replace(",", "").replace("%", "")
    text = text.replace("×", "*").replace("÷", "/").replace("x", "*")
    if len(text) > MAX_EXPRESSION_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError("not arithmetic")

    try:
        return value(tree.body)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def claims(answer: str) -> list[tuple[str, float, float]]:
    """The checkable ``(expression, computed, claimed)`` claims of an answer."""
    out = []
    for expr, claimed in _ANNOTATION.findall(answer) + _INLINE.findall(answer):
        computed, stated = evaluate(expr), _number(claimed)
        if computed is not None and stated is not None:
            out.append((expr.strip(), computed, stated))
    return out


def holds(computed: float, claimed: float) -> bool:
    """Equal up to the rounding of a stated result (a cent, or a millionth relative), or a
    whole number the computed value rounds to (answers round: "you can't buy 2.5 buses")."""
    if abs(computed - claimed) <= max(0.01, 1e-6 * abs(claimed)):
        return True
    return claimed == int(claimed) and claimed in (math.floor(computed), math.ceil(computed))


def arithmetic_score(answer: str) -> float:
    """The share of the answer's checkable claims that hold (1.0 when it makes none)."""
    found = claims(answer)
    if not found:
        return 1.0
    return sum(holds(c, s) for _, c, s in found) / len(found)


async def _verify(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        response = body["response"]
        if not isinstance(response, str):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": "expected {prompt, response}"}, status=400)
    score = arithmetic_score(response)
    return web.json_response({"accept": score == 1.0, "score": score})


def verifier_app() -> web.Application:
    """The verifier as an aiohttp app (``POST /verify``)."""
    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/verify", _verify)
    return app
