"""Tests of verify.py: every answer category in both directions, extraction, hostile inputs, the
labelled case file, determinism across hash seeds, threads and the process-pool batch path."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from bench import verify as B
import verify as V

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
CASES = os.path.join(HERE, "data", "verify_cases.jsonl")
FROZEN = os.path.join(HERE, "data", "verify_test.jsonl")
OUTSIDE = os.path.join(HERE, "data", "verify_outside.jsonl")
HACKING = os.path.join(HERE, "data", "verify_hacking.jsonl")


def _load(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def _judge(c):
    """An answer pair goes to is_equivalent, a whole response to verify(strict=False)."""
    tol = c.get("rel_tol", V.DEFAULT_REL_TOL)
    if "response" in c:
        return V.verify(c["response"], c["gold"], strict=False, rel_tol=tol) == 1.0
    return V.is_equivalent(c["pred"], c["gold"], rel_tol=tol)

# ------------------------------------------------------------------------------------------------
# Equivalence, per category: (pred, gold, expected). Each category has both directions.

EQUIV = {
    "integer": [("42", "42", True), ("042", "42", True), ("42.0", "42", True), ("41", "42", False),
                ("-42", "42", False)],
    "thousands": [("2880", "2,\\!880", True), ("2,880", "2880", True), ("1 000 000", "1000000", True),
                  ("11111111100", "11,\\! 111,\\! 111,\\! 100", True), ("288", "2,\\!880", False)],
    "decimal": [("0.35625", ".35625", True), ("4.5", "\\frac92", True), ("4.49", "4.5", False),
                ("0.333", "\\frac13", False)],
    "fraction": [("5/6", "\\frac{5}{6}", True), ("\\dfrac{10}{12}", "\\frac56", True),
                 ("\\tfrac56", "\\frac{5}{6}", True), ("\\frac 59", "5/9", True),
                 ("\\frac{6}{5}", "\\frac56", False)],
    "mixed_number": [("\\frac95", "1\\frac{4}{5}", True), ("137.5", "137 \\frac{1}{2}", True),
                     ("\\frac45", "1\\frac{4}{5}", False)],
    "percent": [("10", "10\\%", True), ("0.1", "10\\%", True), ("11\\%", "10\\%", False)],
    "scientific": [("4.46\\times10^{19}", "4.46e19", True), ("6.5e-6", "6.5 \\times 10^{-6}", True),
                   ("4.46e18", "4.46e19", False), ("1.24e8", "1.24e-8", False)],
    "sqrt": [("\\sqrt{50}", "5\\sqrt{2}", True), ("\\frac{1}{\\sqrt3}", "\\frac{\\sqrt{3}}{3}", True),
             ("\\sqrt{52}", "5\\sqrt2", False)],
    "nthroot": [("2", "\\sqrt[3]{8}", True), ("2\\sqrt[3]{2}", "\\sqrt[3]{16}", True),
                ("3", "\\sqrt[3]{9}", False)],
    "power": [("1024", "2^{10}", True), ("x^6", "(x^2)^3", True), ("x^5", "(x^2)^3", False)],
    "pi": [("288\\pi", "288 \\pi", True), ("3.14159265", "\\pi", True), ("3.14", "\\pi", False),
           ("\\frac{\\pi}{6}", "-\\frac{\\pi}{6}", False)],
    "infinity": [("(2,\\infty)", "(2, \\infty)", True), ("(-\\infty,2)", "(2,\\infty)", False)],
    "pm": [("1+\\sqrt{19}, 1-\\sqrt{19}", "1 \\pm \\sqrt{19}", True),
           ("1+\\sqrt{19}", "1 \\pm \\sqrt{19}", False)],
    "degrees": [("90", "90^\\circ", True), ("90^{\\circ}", "90", True),
                ("\\frac{\\pi}{2}", "90^\\circ", False)],
    "units_text": [("864", "864 \\mbox{ inches}^2", True), ("5.4", "5.4 \\text{ cents}", True),
                   ("18.90", "\\$18.90", True), ("12 cm", "12", True), ("5", "5.4 \\text{ cents}", False)],
    "leftright": [("(3/2,-13)", "\\left( \\frac{3}{2}, -13 \\right)", True),
                  ("(-13,3/2)", "\\left( \\frac{3}{2}, -13 \\right)", False)],
    "mathrm": [("\\mathrm{12}", "12", True), ("\\mathbf{(B)}", "\\text{(B)}", True),
               ("\\mathbf{13}", "12", False)],
    "equation": [("x=5", "5", True), ("5", "x=5", True), ("y=3+2x", "y = 2x + 3", True),
                 ("10x-14y+22z+8=0", "5x - 7y + 11z + 4 = 0", True), ("x=6", "5", False),
                 ("y=2x-3", "y = 2x + 3", False)],
    "expression": [("(x+2)(x+5)", "x^2+7x+10", True), ("2(k+1)", "2k+2", True),
                   ("\\sin^2 x+\\cos^2 x", "1", True), ("x^2+7x+12", "x^2+7x+10", False),
                   ("q-p", "p - q", False)],
    "tuple": [("(3, -1)", "(3,-1)", True), ("3,-1", "(3,-1)", True), ("(-1,3)", "(3,-1)", False),
              ("(3,-1,0)", "(3,-1)", False)],
    "set": [("\\{3,2,1\\}", "\\{1,2,3\\}", True), ("\\{1,2\\}", "\\{1,2,3\\}", False)],
    "interval": [("[-2,7)", "[-2,7)", True), ("x \\in [-2,7]", "[-2,7]", True),
                 ("(-2,7)", "[-2,7)", False), ("[-2,7]", "[-2,7)", False)],
    "union": [("(9,36)\\cup(0,9)", "(0,9) \\cup (9,36)", True),
              ("(0,36)", "(0,9) \\cup (9,36)", False)],
    "list": [("-2,1", "1,-2", True), ("x=1, x=-2", "1,-2", True), ("1 \\text{ or } -2", "1,-2", True),
             ("1,2", "1,-2", False), ("1", "1,-2", False)],
    "matrix": [("\\begin{bmatrix}1\\\\2\\end{bmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
               ("(1,2)", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
               ("\\begin{pmatrix}-1&0\\\\0&1\\end{pmatrix}",
                "\\begin{pmatrix} -1 & 0 \\\\ 0 & -1 \\end{pmatrix}", False)],
    "choice": [("C", "\\text{(C)}", True), ("\\textbf{(C)} 12", "\\text{(C)}", True),
               ("B", "\\text{(C)}", False)],
    "text": [("Evelyn", "\\text{Evelyn}", True), ("\\text{east}", "east", True),
             ("west", "\\text{east}", False)],
    "complex": [("-5i+6", "6 - 5i", True), ("6+5i", "6 - 5i", False)],
    "minerva": [("1/(a+s)", "\\frac{1}{s+a}", True), ("\\cos(2t)+\\sin(2t)", "\\sqrt{2} \\cos (2 t-\\pi / 4)", True),
                ("\\frac{1}{s-a}", "\\frac{1}{s+a}", False)],
    # Forms added for answers written by other models and graders; each leniency next to its negatives.
    "delimiters": [("$\\frac{4}{7}.$", "\\frac47", True), ("\\[ 9 \\]", "9", True), ("\\( 9 \\)", "9", True),
                   ("$$\n 9 \n$$", "9", True), ("\\boxed{9}", "so $\\boxed{9}$.", True), ("\\( -9 \\)", "9", False),
                   ("\\boxed{8}", "so $\\boxed{9}$.", False)],
    "named": [("(m,n)=(5,2)", "(5,2)", True), ("(m,n)=(2,5)", "(5,2)", False), ("|RS| = 8", "8", True),
              ("E:F = 4:9", "4:9", True), ("E:F = 9:4", "4:9", False), ("s+t = 11", "11", True),
              ("3s = 11", "11", False), ("s^2 = 16", "16", False), ("s = 4", "t = 4", False),
              ("t = 3, s = 1", "(1,3)", True), ("t = 1, s = 3", "(1,3)", False),
              ("f(2) = 9", "9", True), ("f(2) = 9", "2", False), ("x(x+1) = 6", "6", False)],
    "inequality_set": [("[-2, 6]", "-2 \\le y \\le 6", True), ("(-2, 6]", "-2 \\le y \\le 6", False),
                       ("-3y > -9", "y < 3", True), ("-3y > 9", "y < 3", False), ("y >= 1", "[1, \\infty)", True),
                       ("y > 1", "[1, \\infty)", False), ("3 \\le |y| \\le 5", "[-5,-3]\\cup[3,5]", True),
                       ("3 \\le |y| \\le 5", "[3,5]", False),
                       ("y < 0 \\text{ or } y > 1", "(-\\infty,0)\\cup(1,\\infty)", True),
                       ("y > 0 \\text{ and } y < 1", "(-\\infty,0)\\cup(1,\\infty)", False),
                       ("y \\ne 5", "y != 5", True),
                       ("x \\le 2", "y \\le 2", False)],
    "chain": [("w = 3+4+5 = 12", "12", True), ("w = 3+4+5 = 13", "12", False), ("w \\approx 2.5", "2.5", True),
              ("\\frac{5}{7} \\approx 0.71", "\\frac57", True), ("\\frac{4}{7} \\approx 0.57", "\\frac57", False),
              ("3w + 2 = 14", "14", False)],
    "braces_set": [("{5,9}", "\\{5, 9\\}", True), ("{5,8}", "\\{5, 9\\}", False), ("5;9", "5, 9", True),
                   ("(5; 9)", "(5,9)", True), ("(9; 5)", "(5,9)", False), ("\\varnothing", "\\emptyset", True),
                   ("\\varnothing", "\\{0\\}", False)],
    "number_words": [("4,75", "4.75", True), ("4,750", "4750", True), ("4,750", "4.75", False),
                     ("4,57", "4.75", False),
                     ("25 percent", "25\\%", True), ("25 pct", "0.25", True), ("26 percent", "25\\%", False),
                     ("6€", "6", True), ("6€", "7", False), ("1.5m²", "1.5", True), ("15m²", "1.5", False),
                     ("3.1 {m/s^2}", "3.1", True), ("31 {m/s^2}", "3.1", False)],
    "trig_degrees": [("\\sin 60^\\circ", "\\frac{\\sqrt3}{2}", True), ("\\sin 60", "\\frac{\\sqrt3}{2}", False),
                     ("\\tan y", "\\cot(90^\\circ - y)", True), ("\\tan y", "\\cot y", False),
                     ("60^\\circ", "60", True)],
    "set_ops": [("\\{1,3\\} \\cup \\{3,7\\}", "\\{1,3,7\\}", True), ("\\{1,3\\} \\cup \\{7\\}", "\\{1,3\\}", False),
                ("\\mathbb{R} \\setminus \\{2\\}", "(-\\infty,2)\\cup(2,\\infty)", True),
                ("\\mathbb{R} \\setminus \\{2\\}", "(-\\infty,2]\\cup(2,\\infty)", False),
                ("\\mathbb{R} \\setminus \\{3, -1\\}", "(-\\infty,-1)\\cup(-1,3)\\cup(3,\\infty)", True),
                ("\\mathbb{R} \\setminus \\{3, -1\\}", "(-\\infty,3)\\cup(3,\\infty)", False),
                ("\\{x \\mid x > 1\\}", "(1, \\infty)", True), ("\\{x \\mid x > 1\\}", "[1, \\infty)", False),
                ("[[1,0],[2,3]]", "\\begin{pmatrix}1&0\\\\2&3\\end{pmatrix}", True),
                ("[[1,2],[0,3]]", "\\begin{pmatrix}1&0\\\\2&3\\end{pmatrix}", False),
                ("x < 1, x > 2", "(-\\infty,1)\\cup(2,\\infty)", False)],     # a comma list of relations: no set
    "inverse_trig": [("\\sin^{-1} \\frac12", "\\frac{\\pi}{6}", True), ("\\sin(x)^2", "\\sin^2 x", True),
                     ("\\sin(x)^2", "\\sin(x^2)", False), ("(\\sin 1)^{-1}", "\\sin^{-1} 1", False)],
    "ratio_comma": [("4:6", "2:3", True), ("3:2", "2:3", False), ("1:3:2", "1:2:3", False),
                    ("07:30", "07:30", True), ("2,5", "2.5", True), ("2.5", "2,5", True),
                    ("25", "2,5", False), ("5.2", "2,5", False)],
    "brackets_ordinals": [("\\langle 2, 5 \\rangle", "(2,5)", True), ("\\langle 5, 2 \\rangle", "(2,5)", False),
                          ("3^{\\text{rd}}", "3", True), ("31st", "13", False), ("y + 3rd", "y + 3", False),
                          ("9 marbles", "9", True), ("9 marbles", "8", False),
                          ("\\lvert -3 \\rvert", "3", True), ("\\lvert -3 \\rvert", "-3", False)],
    "undefined": [("0/0", "0/0", False), ("\\frac{1}{0}", "\\frac{1}{0}", False), ("nan", "nan", False),
                  ("zoo", "zoo", False), ("\\frac{0}{0}", "0", False)],
}


@pytest.mark.parametrize("pred,gold,expected,cat", [
    (p, g, e, cat) for cat, rows in EQUIV.items() for p, g, e in rows])
def test_equivalence(pred, gold, expected, cat):
    assert V.is_equivalent(pred, gold) is expected, (cat, pred, gold)


def test_every_category_has_both_directions():
    for cat, rows in EQUIV.items():
        if cat == "undefined":
            continue
        assert {e for _, _, e in rows} == {True, False}, cat


def test_decimal_must_round_to_exact_gold():
    assert V.is_equivalent("0.8333", "\\frac56")
    assert V.is_equivalent("3.14159265", "\\pi")
    assert not V.is_equivalent("100.01", "100")          # within 1e-4, but not a rounding of 100
    assert not V.is_equivalent("1.000001", "1")
    assert V.is_equivalent("901.8", "900", rel_tol=V.MINERVA_REL_TOL)   # Minerva golds are rounded


def test_rel_tol_is_configurable():
    # Minerva golds carry about three significant figures.
    assert not V.is_equivalent("4.4625e19", "4.46e19")
    assert V.is_equivalent("4.4625e19", "4.46e19", rel_tol=V.MINERVA_REL_TOL)
    assert not V.is_equivalent("4.7e19", "4.46e19", rel_tol=V.MINERVA_REL_TOL)


# ------------------------------------------------------------------------------------------------
# Forms that answers from other graders' suites use: each leniency next to the near misses it must
# keep out. (pred, gold, expected)

def _check(rows):
    wrong = [(p, g, e) for p, g, e in rows if V.is_equivalent(p, g) is not e]
    assert not wrong, wrong


def test_named_functions():
    _check([("\\gcd(12, 18)", "6", True), ("\\gcd(12, 18)", "3", False), ("gcd(12,18)", "6", True),
            ("\\operatorname{lcm}(4, 6)", "12", True), ("\\operatorname{lcm}(4, 6)", "24", False),
            ("\\max(2, 9)", "9", True), ("\\max(2, 9)", "2", False), ("\\min\\{4, 1, 3\\}", "1", True),
            ("\\max(a, b)", "\\max(b, a)", True), ("\\max(a, b)", "\\min(a, b)", False),
            ("\\max(x, -x)", "|x|", True), ("\\operatorname{floor}(9/2)", "4", True),
            ("\\operatorname{ceil}(9/2)", "4", False), ("\\lg 1000", "3", True), ("\\lg 1000", "\\ln 1000", False),
            ("\\operatorname{arcsinh} x", "\\ln(x + \\sqrt{x^2+1})", True),
            ("\\sinh^{-1} x", "\\operatorname{arcsinh} x", True), ("\\arccosh x", "\\arcsinh x", False),
            ("\\operatorname{cosec} y", "\\frac{1}{\\sin y}", True), ("cosec y", "\\sec y", False)])


def test_mod_and_det():
    _check([("23 \\bmod 7", "2", True), ("23 \\bmod 7", "3", False), ("23 mod 7", "2", True),
            ("y \\equiv 4 \\pmod{9}", "4", True), ("y \\equiv 5 \\pmod{9}", "4", False),
            ("4 \\pmod 9", "4", True), ("4 \\pmod 9", "9", False),
            ("\\det\\begin{pmatrix}2&1\\\\1&3\\end{pmatrix}", "5", True),
            ("\\det\\begin{pmatrix}2&1\\\\1&3\\end{pmatrix}", "7", False),
            ("\\begin{vmatrix}2&1\\\\1&3\\end{vmatrix}", "5", True)])


def test_factorials_and_binomials_of_symbols():
    _check([("k \\cdot (k-1)!", "k!", True), ("(k-1)!", "k!", False), ("\\frac{(k+1)!}{(k-1)!}", "k(k+1)", True),
            ("\\frac{(k+1)!}{(k-1)!}", "k(k-1)", False), ("\\binom{k}{2}", "\\frac{k(k-1)}{2}", True),
            ("\\binom{k}{2}", "\\frac{k(k+1)}{2}", False), ("\\binom{k}{k}", "1", True), ("\\binom{k}{1}", "1", False),
            ("\\tbinom{8}{3}", "56", True), ("C(8,3)", "56", True), ("C(8,3)", "24", False),
            ("{k \\choose 2}", "\\binom{k}{2}", True), ("C(3,8)", "0", False)])


def test_sums_and_products_with_numeric_bounds():
    _check([("\\sum_{k=1}^{5} k^2", "55", True), ("\\sum_{k=1}^{5} k^2", "54", False),
            ("\\sum_{i=1}^{3} i", "6", True),                        # i is the index, not sqrt(-1)
            ("\\prod_{i=1}^{2}(y+i)", "(y+1)(y+2)", True), ("\\prod_{i=1}^{2}(y+i)", "(y+1)^2", False),
            ("\\sum_{n=1}^{2} \\frac{1}{n}", "\\frac32", True), ("\\sum_{n=1}^{2} \\frac{1}{n} + 1", "\\frac32", False),
            ("\\sum_{k=1}^{n} k", "\\frac{n(n+1)}{2}", True), ("\\sum_{k=1}^{n} k", "\\frac{n(n-1)}{2}", False),
            ("\\sum_{k=1}^{n-1} k", "\\frac{n(n-1)}{2}", True),
            ("\\sum_{k=0}^{n} k^2", "\\frac{n(n+1)(2n+1)}{6}", True),
            ("\\sum_{k=1}^{n} k^2", "\\frac{n(n+1)(2n-1)}{6}", False), ("\\prod_{k=1}^{n} k", "n!", True),
            ("\\prod_{k=1}^{n} k", "(n+1)!", False), ("\\sum_{k=1}^{n} x^k", "\\frac{x(x^n-1)}{x-1}", True),
            ("\\sum_{k=1}^{n} x^k", "\\frac{x^n-1}{x-1}", False)])      # symbolic bounds: integer points


def test_outside_forms_with_near_misses():
    """Forms other graders' and CAS answer tests use, each beside the near misses it must refuse."""
    _check([("sec(3*u)^2*(1+tan(3*u))", "sec(3*u)^2+sec(3*u)^2*tan(3*u)", True),
            ("sec(3*u)^2*(1-tan(3*u))", "sec(3*u)^2+sec(3*u)^2*tan(3*u)", False),
            ("3*sec(3*u)^2", "3/cos(3*u)^2", True), ("3*sec(3*u)^2", "-3/cos(3*u)^2", False),
            ("cosech(u)", "1/sinh(u)", True), ("cosech(u)", "1/cosh(u)", False), ("csch(u)^2", "coth(u)^2 - 1", True),
            ("\\operatorname{sech}^2 u", "1-\\tanh^2 u", True), ("\\operatorname{sech}^2 u", "1+\\tanh^2 u", False),
            ("\\coth u", "\\frac{\\cosh u}{\\sinh u}", True), ("arccot(2)", "arctan(1/2)", True),
            ("[0,3] \\setminus (1,2)", "[0,1] \\cup [2,3]", True),
            ("[0,3] \\setminus (1,2)", "[0,1) \\cup (2,3]", False),
            ("[0,3] \\setminus [1,2]", "[0,1) \\cup (2,3]", True),
            ("\\mathbb{R} \\setminus (-1, 1)", "|x| \\ge 1", True),
            ("\\mathbb{R} \\setminus [-1, 1]", "|x| \\ge 1", False),
            ("(x < 1) \\text{ or } (x > 3)", "(-\\infty,1) \\cup (3,\\infty)", True),
            ("(x < 1) \\text{ or } (x > 3)", "(-\\infty,1] \\cup (3,\\infty)", False),
            ("(x > 1) \\text{ and } (x < 3)", "(1,3)", True), ("(x > 1) \\text{ or } (x < 3)", "(1,3)", False),
            ("x = 2 \\pm \\sqrt{3}", "x = 2+\\sqrt3 \\text{ or } x = 2-\\sqrt3", True),
            ("x = 2 \\pm \\sqrt{3}", "x = 2+\\sqrt3", False),
            ("x = 2 \\pm \\sqrt{3}", "x = 2+\\sqrt3 \\text{ or } x = 3-\\sqrt3", False),
            ("\\frac{x^2}{|x|}", "|x|", True), ("\\frac{x^2}{|x|}", "x", False), ("|x| \\cdot |x|", "x^2", True),
            ("\\sqrt{3+2\\sqrt{2}}", "1+\\sqrt2", True), ("\\sqrt{3+2\\sqrt{2}}", "\\sqrt2 - 1", False),
            ("\\sqrt{5+2\\sqrt{6}}", "\\sqrt2+\\sqrt3", True), ("\\sqrt{5-2\\sqrt{6}}", "\\sqrt2+\\sqrt3", False),
            ("-3 \\mod 4", "1", True), ("-3 \\bmod 4", "-3", False), ("(-3) \\bmod 4", "1", True),
            ("-3 \\bmod 4", "3", False),
            ("The total cost is 3,15 €.", "3.15", True), ("The total cost is 3,15 €.", "315", False),
            ("The area is 2,000.5 m².", "2000.5", True), ("The area is 2,000.5 m².", "2.0005", False),
            # Prose between two boxes: the last box is the answer, never the pair.
            ("The roots are $\\boxed{2}$ and, after checking, $\\boxed{5}$.", "2, 5", False),
            ("The roots are $\\boxed{2}$ and, after checking, $\\boxed{5}$.", "5", True),
            ("((1,2),(3,4))", "(3,4), (1,2)", True), ("(1,2),(3,4)", "((3,4), (1,2))", True),
            ("((2,1),(3,4))", "(3,4), (1,2)", False), ("((1,2),(3,5))", "(3,4), (1,2)", False)])


def test_relations_in_other_spellings():
    _check([("t \\le 3 \\text{ and } t \\ge 3", "t = 3", True), ("t \\le 3 \\text{ and } t \\ge 2", "t = 3", False),
            ("(1, 4)", "1 < h(x) < 4", True), ("[1, 4)", "1 < h(x) < 4", False),
            ("-1 \\le z \\le 5", "-1 \\\\le z \\\\le 5", True), ("-1 \\le z \\le 5", "-1 \\\\le z \\\\le 6", False),
            ("6y < 12a", "y - 2a < 0", True), ("6y < 12a", "2a - y < 0", False), ("x \\not= 3", "x \\ne 3", True),
            ("y = \\sqrt{x^2}", "y = x", False), ("y = |x|", "y = \\sqrt{x^2}", True)])


def test_equations_compare_solution_sets():
    _check([("u^3 = v^3", "u = v", True), ("u^2 = v^2", "u = v", False), ("u^4 = v^4", "u^2 = v^2", True),
            ("v^3 = 27u^3", "v = 3u", True), ("v^3 = 27u^3", "v = -3u", False), ("uv = 2", "v = \\frac{2}{u}", True),
            ("u^2 v = v", "u^2 = 1", False), ("v = \\sqrt{u^2}", "v = u", False), ("v = \\sqrt{u^2}", "v = |u|", True)])


def test_sets_with_repeats_and_interval_algebra():
    _check([("\\{4, 7, 4\\}", "\\{7, 4\\}", True), ("\\{4, 7, 4\\}", "\\{4\\}", False),
            ("[1, 3] \\cap [3, 6]", "\\{3\\}", True), ("[1, 3) \\cap [3, 6]", "\\{3\\}", False),
            ("[1, 3) \\cap [3, 6]", "\\emptyset", True), ("[1, 3] \\cap [3, 6]", "\\emptyset", False),
            ("\\{1, 4\\} \\cap \\{4, 5\\}", "\\{4\\}", True), ("\\{1, 4\\} \\cap \\{4, 5\\}", "\\{1, 4, 5\\}", False)])


def test_numbers_as_written():
    _check([("Answer $ 21 $", "21", True), ("Answer $ 12 $", "21", False), ("0,375", "0.375", True),
            ("0,375", "375", False), ("4.25", "4,25", True), ("425", "4,25", False),
            ("3,25 kg", "3.25", True), ("3,25 kg", "32.5", False), ("2,400.75 EUR", "2400.75", True),
            ("2,400.75 EUR", "240075", False), ("USD 3,500", "3500", True), ("USD 3,500", "3.5", False)])


def test_labelled_answers_in_either_order():
    _check([("m=2, n=1; m=4, n=3", "(2,1), (4,3)", True), ("m=2, n=1; m=4, n=4", "(2,1), (4,3)", False),
            ("(2,1), (4,3)", "m=2, n=1; m=4, n=3", True), ("(2,1), (3,4)", "m=2, n=1; m=4, n=3", False),
            ("8, 5", "AB = 8, CD = 5", True), ("8, 6", "AB = 8, CD = 5", False),
            ("A_1 : A_2 = 2 : 13", "2:13", True), ("A_1 : A_2 = 13 : 2", "2:13", False),
            ("0", "uv = 0", False), ("0", "y' + ry = 0", False),         # equations, not labels
            ("2:13", "A_{1}:A_{2}=2:13", True), ("2:15", "A_{1}:A_{2}=2:13", False)])


def test_matrix_algebra():
    m = "\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}"
    _check([(m + "^T", "\\begin{bmatrix}1&3\\\\2&4\\end{bmatrix}", True), (m + "^T", m, False),
            ("3" + m, "\\begin{pmatrix}3&6\\\\9&12\\end{pmatrix}", True), ("3" + m, m, False),
            ("-" + m, "\\begin{pmatrix}-1&-2\\\\-3&-4\\end{pmatrix}", True),
            (m + " + " + m, "2" + m, True), (m + " - " + m, "2" + m, False),
            ("\\begin{array}{cc}1&2\\\\3&4\\end{array}", m, True)])


def test_implicit_products_and_absolute_values():
    _check([("|p|\\,|q|", "|pq|", True), ("|p|\\,|q|", "|p+q|", False), ("|p||q|", "|pq|", True),
            ("3|p|", "|3p|", True), ("3|p|", "3|q|", False),
            ("\\frac{1}{2}pq(p-q)", "\\frac{p^2q-pq^2}{2}", True), ("2pq^2", "2p^2q", False),
            ("\\frac{pq}{3}r", "\\frac{pqr}{3}", True), ("pqr", "pq w", False), ("east", "e a s t", False)])


def test_sentences_and_named_chains_as_answer_pairs():
    _check([("Thus $y \\le 4$ is the solution.", "y \\le 4", True),
            ("Thus $y \\le 4$ is the solution.", "y < 4", False),
            ("We get that $y \\gt 4$.", "y > 4", True), ("We get that $y \\gt 4$.", "y < 4", False),
            ("Here it is: $\\begin{pmatrix}1&0\\\\0&1\\end{pmatrix}$.",
             "\\begin{bmatrix}1&0\\\\0&1\\end{bmatrix}", True),
            ("Here it is: $\\begin{pmatrix}1&0\\\\0&2\\end{pmatrix}$.",
             "\\begin{bmatrix}1&0\\\\0&1\\end{bmatrix}", False),
            ("y = 4+4+1 = 9", "y = 9", True), ("y = 4+4+1 = 9", "z = 9", False), ("y = 4+4 = 9", "y = 8", False),
            ("y = 6+3 = 9", "y = 1 + 8 = 9", True), ("y = 6+3 = 9", "y = 1 + 9 = 10", False),
            ("x = 1, x = 2 \\pm \\sqrt{3}", "x = 1, x = 2 + \\sqrt{3}, x = 2 - \\sqrt{3}", True),
            ("x = 1, x = 2 \\pm \\sqrt{3}", "x = 1, x = 2 + \\sqrt{3}", False),
            ("\\boxed{7}\\boxed{9}", "7, 9", True), ("\\boxed{7}\\boxed{9}", "9", False),
            ("u = -2,\\ v = 3", "(-2, 3)", True), ("28 percentage", "28\\%", True), ("27 percentage", "28\\%", False)])


def test_sympy_printed_answers():
    _check([("Interval.Ropen(0, 2)", "[0, 2)", True), ("Interval.Ropen(0, 2)", "(0, 2]", False),
            ("Interval(0, 2)", "0 \\le t \\le 2", True), ("FiniteSet(3, 1)", "\\{1, 3\\}", True),
            ("FiniteSet(3, 1)", "\\{1, 2\\}", False), ("Union(Interval.open(-oo, 0), Interval.open(1, oo))",
                                                     "t < 0 \\text{ or } t > 1", True),
            ("Eq(y, 3*x)", "y = 3x", True), ("Eq(y, 3*x)", "y = 3x + 1", False), ("Rational(2, 7)", "\\frac27", True),
            ("Abs(x - 2)", "|x-2|", True), ("binomial(6, 3)", "20", True), ("factorial(4)", "24", True),
            ("log(x, 3)", "\\log_3 x", True), ("log(x, 3)", "\\log_2 x", False), ("EmptySet", "\\emptyset", True)])


def test_ellipsis_is_not_a_finite_list():
    _check([("3, 6, 9, \\ldots", "3, 6, 9", False), ("\\{3, 6, 9, \\dots\\}", "\\{3, 6, 9\\}", False),
            ("3, 6, 9, \\ldots", "3, 6, 9, \\cdots", True)])


# ------------------------------------------------------------------------------------------------
# Extraction and verify()

def test_extract_answer():
    assert V.extract_answer("so \\boxed{\\frac{1}{2}}. Adding 2.5 gives \\boxed{3}") == "3"   # last box
    assert V.extract_answer("so \\boxed{\\frac{1}{2}} and \\boxed{3}") == "\\frac{1}{2}, 3"     # one answer
    assert V.extract_answer("\\boxed{\\frac{a}{\\{b\\}}}") == "\\frac{a}{\\{b\\}}"
    assert V.extract_answer("x = \\fbox{7}") == "7"
    assert V.extract_answer("thus $\\boxed 5$.") == "5"
    assert V.extract_answer("\\boxed{1} then \\boxed{", strict=True) is None   # last box unclosed
    assert V.extract_answer("The final answer is $12$.", strict=True) is None
    assert V.extract_answer("The final answer is $12$.") == "12"
    assert V.extract_answer("we get 3 apples and then 17 pears") == "17"
    assert V.extract_answer("no answer here") is None
    assert V.extract_answer("\\boxed{1} then \\boxed{") is None                 # truncated: no fallback either
    assert V.extract_answer("3 or 4") == "3 or 4"                                  # a bare answer is read whole
    assert V.extract_answer("1, 3, 5, ...") == "1, 3, 5, ..."                     # its dots are no full stop
    assert V.extract_answer("we counted 1,3,5") == "5"                             # a list is not the number 135
    assert V.extract_answer("we counted 2,880,000") == "2,880,000"
    assert V.extract_answer("then we add 3 to get 5", last_number=False) is None


def test_extract_answer_forms():
    minerva = "Thus $y=4$.\nFinal Answer: The final answer is $4$. I hope it is correct."
    assert V.extract_answer(minerva) == "4"
    assert V.extract_answer(minerva, strict=True) is None                  # training: boxed only
    assert V.extract_answer("The answer is $\\frac{2}{9}.$") == "\\frac{2}{9}"
    assert V.extract_answer("Answer: 17") == "17"
    assert V.extract_answer("So 3 + 4 = 7.\n#### 7") == "7"
    assert V.extract_answer("so we get $q \\le 2$ as required.") == "q \\le 2"   # last math span
    assert V.extract_answer("The zeros are $x=1$ and $x=6$.") == "x=1, x=6"          # spans joined
    # Several boxes make one answer only when nothing but ',', 'and', 'or', 'x =' stands between.
    assert V.extract_answer("$\\boxed{1}$, $\\boxed{6}$") == "1, 6"
    assert V.extract_answer("$a=\\boxed{1}$ and $b=\\boxed{6}$") == "1, 6"
    assert V.extract_answer("The radius is \\boxed{3}. Its area is then 9 pi, so \\boxed{9\\pi}") == "9\\pi"
    assert V.extract_answer("\\boxed{5} and again \\boxed{5}") == "5"
    assert V.extract_answer("\\boxed{5}, \\boxed{5}") == "5"                        # the same box twice
    # Nothing after the end of the turn counts, nor a next few-shot problem after an answer.
    assert V.extract_answer("\\boxed{3}<|im_end|>\n<|im_start|>user\n\\boxed{4}") == "3"
    assert V.extract_answer("<|im_start|>assistant\n\\boxed{3}<|im_end|>") == "3"
    assert V.extract_answer("no box<|eot_id|>\\boxed{4}", strict=True) is None
    assert V.extract_answer("Final Answer: The final answer is $2$.\n\nProblem:\nFind $z$.\n"
                            "Final Answer: The final answer is $5$.") == "2"
    assert V.extract_answer("Problem: find $z$.\nSolution: $z=5$.\n\\boxed{5}") == "5"


def test_verify_whole_responses_and_worked_gold():
    gold = "Since $x + 2 = 9$, we get $x = \\boxed{7}$."
    assert V.verify("so \\boxed{7}", gold) == 1.0
    assert V.verify("so \\boxed{9}", gold) == 0.0
    assert V.is_equivalent("7", gold)
    assert V.is_equivalent("7", "A long worked solution. " * 200 + gold)          # longer than the cap
    assert not V.is_equivalent("7", "x" * 5000)
    assert V.verify("Final Answer: The final answer is $7$. I hope it is correct.", gold, strict=False) == 1.0
    assert V.verify("Final Answer: The final answer is $7$. I hope it is correct.", gold) == 0.0
    assert V.verify("$x=\\boxed{2}$ or $x=\\boxed{-2}$", "\\pm 2") == 1.0
    assert V.verify("$x=\\boxed{2}$ or $x=\\boxed{-2}$", "2") == 0.0      # two answers for one
    assert V.verify("$x=\\boxed{2}$ or $x=\\boxed{3}$", "\\pm 2") == 0.0


def test_whole_responses_in_other_shapes():
    ok = [("<think>\nperhaps \\boxed{9}? no.\n</think>\nThe answer is 8.", "8"),
          ("Checking each case.\nFinal Answer: The least $n$ is 8.", "8"),
          ("Final Answer: The least $n$ is $\\frac{16}{2}$.", "8"), ("综上，答案：B", "B"),
          ("Donc $x$ vaut 4.\nRéponse : 8", "8"), ("5+3", "8"),
          ("$\\lim_{x \\to 0} \\frac{x}{x} = 1$", "1"),
          ("So $\\boxed{1} \\quad \\text{and} \\quad \\boxed{4}$.", "1, 4"),
          ("One root is $\\boxed{1}$; the other, after the check, is $\\boxed{4}$.", "4")]
    bad = [("<think>\nperhaps \\boxed{9}? no.\n</think>\nThe answer is 8.", "9"),
           ("Checking each case.\nFinal Answer: The least $n$ is 7.", "8"), ("综上，答案：C", "B"),
           ("Ответ: 7", "8"),
           ("5+3", "53"),
           ("5+3", "3"), ("$\\lim_{x \\to 0} \\frac{x}{x} = 1$", "0"),
           ("One root is $\\boxed{1}$; the other, after the check, is $\\boxed{4}$.", "1, 5"),
           ("One root is $\\boxed{1}$; the other, after the check, is $\\boxed{4}$.", "1, 4"),
           ("One root is $\\boxed{1}$; the other, after the check, is $\\boxed{4}$.", "1")]
    assert [r for r, g in ok if V.verify(r, g, strict=False) != 1.0] == []
    assert [r for r, g in bad if V.verify(r, g, strict=False) != 0.0] == []
    # Training (strict): only boxes count, also after a reasoning trace.
    assert V.verify("<think>\\boxed{9}</think>\nso \\boxed{8}", "8") == 1.0
    assert V.verify("<think>\\boxed{8}</think>\nso 9", "8") == 0.0


def test_verify_and_batch_in_process():
    assert V.verify("... so \\boxed{2,\\!880}.", "2880") == 1.0
    assert V.verify("... so 2880.", "2880") == 0.0                     # strict: boxed only
    assert V.verify("... so 2880.", "2880", strict=False) == 1.0
    assert V.verify("\\boxed{0.5}", "\\boxed{\\frac12}") == 1.0
    assert V.verify_batch(["\\boxed{1}", "\\boxed{2}", "x"], ["1", "1", "1"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        V.verify_batch(["a"], [])


# ------------------------------------------------------------------------------------------------
# Hostile inputs: prompt, no exception, no code run.

HOSTILE = [
    "\\boxed{",
    "\\boxed{" + "1" * 100_000 + "}",
    "x" * 100_000,
    "\\boxed{" + "{" * 1000 + "1" + "}" * 1000 + "}",
    "\\boxed{" + "(" * 1000 + "1" + ")" * 1000 + "}",
    "\\boxed{10^{10^{10^{10}}}}",
    "\\boxed{9**9**9**9}",
    "\\boxed{2^{2^{2^{2^{2^{2}}}}}}",
    "\\boxed{(10^{100})!}",
    "\\boxed{e^{e^{e^{e^{100}}}}}",
    "\\boxed{x^{10^{10}}}",
    "\\boxed{\\sqrt[10^{9}]{2}}",
    "\\boxed{1e999999999}",
    "\\boxed{__import__('os').system('true')}",
    "\\boxed{\\def\\x{5}\\x}",
    "\\boxed{5\x00}",
    "\\boxed{\ud800\udfff}",
    "\\boxed{" + "-" * 5000 + "1}",
    "\\boxed{" + "1+" * 700 + "1}",
    "\\boxed{" + "\\frac{1}{" * 300 + "2" + "}" * 300 + "}",
    "\\boxed{\\begin{pmatrix}" + "1&" * 400 + "1\\end{pmatrix}}",
    "\\boxed{1}, " * 20_000,
    "$1$ and " * 20_000,
    "The answer is $" * 10_000,
    "\\boxed{" + "x<" * 500 + "1}",
    "\\boxed{" + "|x|<" * 300 + "1}",
    "\\boxed{" + "{1," * 500 + "1" + "}" * 500 + "}",
    "\\boxed{" + "<|im_end|>" * 5000 + "}",
    "\\boxed{" + "x=" * 700 + "1}",
    "The answer is 1." + "\nProblem:" * 20_000,
    "\\{x | " + " " * 1400 + "x\\}",
    "1" + "m/s" * 450,
    "\\boxed{\\sum_{k=1}^{10^{9}} k}",
    "\\boxed{\\sum_{k=1}^{1000}\\sum_{j=1}^{1000} j}",
    "\\boxed{\\gcd(10^{5000}, 10^{4000})}",
    "\\boxed{\\binom{10^{10}}{5}}",
    "\\boxed{(10^{100}+\\frac12)!}",
    "\\boxed{\\max(" + "1," * 5000 + "1)}",
    "\\boxed{\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}" + "^T" * 2000 + "}",
    "\\boxed{" + "|a|" * 500 + "}",
    "\\boxed{" + "\\sum_{k=1}^{9}" * 50 + "k}",
    "<think>" * 5000 + "</think>" * 5000 + "\\boxed{1}",
    "V_1 : V_2 = " * 300 + "1:2",
    "\\boxed{" + "FiniteSet(" * 700 + "1" + ")" * 700 + "}",
    "\\boxed{" + "Interval(0, " * 300 + "1" + ")" * 300 + "}",
    # Python-looking and oversized junk of the kinds a policy under RL stumbles on.
    "\\boxed{" + "a0" * 700 + "}",
    "\\boxed{" + "x." * 700 + "0}",
    "\\boxed{" + "f(" * 400 + "0" + ")" * 400 + "}",
    "\\boxed{" + "'" * 1400 + "}",
    "\\boxed{" + ", ".join(["\\pm 1"] * 300) + "}",
    "\\boxed{\\{" + ", ".join(str(k) for k in range(400)) + "\\}}",
    "\\boxed{" + "\\sqrt{" * 400 + "2" + "}" * 400 + "}",
    "\\boxed{" + "\\sin(" * 300 + "x" + ")" * 300 + "}",
    "\\boxed{" + "2^" * 700 + "2}",
    "\\boxed{" + "|" * 1400 + "}",
    "\\boxed{" + "1, 3, 5, \\ldots, " * 80 + "}",
    "\\boxed{" + "4 \\text{ or } " * 100 + "4}",
    "\\boxed{" + "\\sum_{j=1}^{m}" * 60 + "j}",
    "\\boxed{" + "[0,3] \\setminus " * 100 + "(1,2)}",
    "\\boxed{" + "x = 1 \\pm " * 200 + "2}",
    "\\boxed{" + "((1,2),(3,4)), " * 100 + "(5,6)}",
    "\\boxed{\\sqrt{2+\\sqrt{" * 150 + "3" + "}}" * 150 + "}",
    "\\boxed{x^{" + "x^{" * 300 + "2" + "}" * 301 + "}",
    "\\boxed{" + "3,15 € " * 200 + "}",
    "\\boxed{e^{\\pi\\sqrt{163}}}",
    # the readers of answer tags, hidden text, markdown and answer cues in other scripts
    "<answer>" * 30000, "<answer>" + "</answer><answer>" * 20000 + "7</answer>", "<!--" * 50000,
    "\\iffalse " * 20000, "{\\color{white} " * 20000 + "\\boxed{7}", "~~" * 100000, "**" * 100000 + "\\boxed{7}",
    "\\phantom{" * 30000, "所以" * 50000 + "45", "\\boxed{7}" + " or equivalently " * 10000, "<think>" * 30000,
]


@pytest.mark.parametrize("i", range(len(HOSTILE)))
def test_hostile_inputs_return_promptly(i):
    text = HOSTILE[i]
    for gold in ("1", "10^{10^{10^{10}}}", text[7:-1] if text.startswith("\\boxed{") else "x"):
        t = time.perf_counter()
        r = V.verify(text, gold)
        dt = time.perf_counter() - t
        assert r in (0.0, 1.0)
        assert dt < 1.0, (i, dt)
        t = time.perf_counter()
        V.is_equivalent(text, gold)
        assert time.perf_counter() - t < 1.0
        t = time.perf_counter()
        assert V.verify(text, gold, strict=False) in (0.0, 1.0)     # the fallback extraction paths
        assert time.perf_counter() - t < 1.0


def test_huge_values_are_not_equivalent_and_counted():
    V.reset_stats()
    assert not V.is_equivalent("10^{10^{10^{10}}}", "10^{10^{10^{10}}}")
    assert not V.is_equivalent("9**9**9**9", "9**9**9**9")
    assert V.stats()["limit_hits"] >= 2


def test_no_code_runs(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {marker}')",
                f"exec(\"open('{marker}','w')\")", f"eval('open(\"{marker}\",\"w\")')",
                f"\\input{{{marker}}}", f"\\write18{{touch {marker}}}"]
    for p in payloads:
        V.verify("\\boxed{" + p + "}", p)
        V.is_equivalent(p, p)
    assert not marker.exists()


def test_threads_agree_with_serial():
    cases = [c for c in _load(CASES) if "pred" in c][:120]
    want = [V.is_equivalent(c["pred"], c["gold"]) for c in cases]
    got = [None] * len(cases)

    def work(k):
        for j in range(k, len(cases), 4):
            got[j] = V.is_equivalent(cases[j]["pred"], cases[j]["gold"])
    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


# ------------------------------------------------------------------------------------------------
# The labelled case file, determinism, and the process pool.

def test_case_file_accuracy():
    cases = _load(CASES)
    assert len(cases) >= 400
    fp = fn = 0
    for c in cases:
        r = _judge(c)
        fp += r and not c["label"]
        fn += c["label"] and not r
    acc = 1 - (fp + fn) / len(cases)
    assert acc >= 0.97, (acc, fp, fn)
    assert fp / len(cases) < 0.01, fp


def test_frozen_file_is_well_formed_and_safe():
    """The frozen file (written before the verifier was extended for it, never tuned against) has both
    kinds of cases and both labels; on it the verifier gives no exception and under 1% false positives.
    Its accuracy is a benchmark figure (`python -m bench.verify`), not a test threshold."""
    cases = _load(FROZEN)
    assert len(cases) >= 400
    assert all(("pred" in c) != ("response" in c) and isinstance(c["label"], bool) for c in cases)
    assert {c["label"] for c in cases} == {True, False} and any("response" in c for c in cases)
    V.reset_stats()
    fp = sum(_judge(c) and not c["label"] for c in cases)
    assert V.stats()["errors"] == 0
    assert fp / len(cases) < 0.01, fp


def test_outside_frozen_file_accuracy():
    """The file of cases by answer form from other graders' documented behaviour, written and frozen
    before the verifier was extended for those forms: accuracy and false positives on it."""
    cases = _load(OUTSIDE)
    assert len(cases) >= 300 and any("response" in c for c in cases)
    n_neg = sum(not c["label"] for c in cases)
    assert 0.45 <= n_neg / len(cases) <= 0.55, n_neg
    V.reset_stats()
    verdicts = [_judge(c) for c in cases]
    fp = sum(v and not c["label"] for v, c in zip(verdicts, cases))
    acc = sum(v == c["label"] for v, c in zip(verdicts, cases)) / len(cases)
    assert V.stats()["errors"] == 0
    assert acc >= 0.95, acc
    assert fp / len(cases) < 0.01, fp


# ------------------------------------------------------------------------------------------------
# Reward hacking: responses a policy under RL could find that must score 0, by kind, each kind with
# controls (the same forms used honestly) that must score 1. One answer gets one verdict whatever
# wraps it: the boxed answer of a response is also judged bare, in dollars and boxed by is_equivalent,
# as a whole response without a box by verify(strict=False), and boxed by verify() in training mode.

_HACK = _load(HACKING)
_BOXED_ANSWER_RE = re.compile(r"^Working through the steps, the final answer is \$\\boxed\{(.*)\}\$\.$", re.DOTALL)


def test_hacking_file_shape():
    kinds = {}
    for c in _HACK:
        assert ("pred" in c) != ("response" in c) and isinstance(c["label"], bool), c
        kinds.setdefault(c["category"], set()).add(c["label"])
    assert sum(not c["label"] for c in _HACK) >= 120
    assert all(labels == {True, False} for labels in kinds.values()), kinds
    assert len(kinds) >= 14


@pytest.mark.parametrize("k", range(len(_HACK)))
def test_reward_hacking(k):
    c = _HACK[k]
    assert _judge(c) is c["label"], c
    if "response" in c:
        boxed = "\\boxed" in c["response"] or "\\fbox" in c["response"]
        assert V.verify(c["response"], c["gold"]) == float(c["label"] and boxed), c     # training: strict
        m = _BOXED_ANSWER_RE.match(c["response"])
        if m:
            ans = m.group(1)
            for wrapped in (ans, f"${ans}$", f"\\boxed{{{ans}}}", f"\\( {ans} \\)"):
                assert V.is_equivalent(wrapped, c["gold"]) is c["label"], (wrapped, c)
            for unboxed in (ans, f"${ans}$", f"So the answer is ${ans}$.", f"\\[{ans}\\]"):
                assert V.verify(unboxed, c["gold"], strict=False) == float(c["label"]), (unboxed, c)
    else:
        for wrapped in (c["pred"], f"\\boxed{{{c['pred']}}}"):
            assert V.verify(wrapped, c["gold"], strict=False) == float(c["label"]), (wrapped, c)


_DET_SCRIPT = r"""
import json, sys
from bench import verify as B
cases = [json.loads(l) for l in open(sys.argv[1], encoding="utf-8")]
print("".join("1" if B.judge_ours(c) else "0" for c in cases))
"""


def test_determinism_across_hash_seeds():
    outs = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=HERE)
        r = subprocess.run([sys.executable, "-c", _DET_SCRIPT, CASES], env=env, cwd=HERE,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] and len(outs[0]) >= 400


def test_verify_batch_workers_match():
    cases = [c for c in _load(CASES) if "pred" in c][::4]
    responses = ["so \\boxed{" + c["pred"] + "}" for c in cases]
    golds = [c["gold"] for c in cases]
    one = V.verify_batch(responses, golds, workers=1)
    two = V.verify_batch(responses, golds, workers=2)
    assert one == two
    assert len(one) == len(cases) and set(one) <= {0.0, 1.0}


# ------------------------------------------------------------------------------------------------
# One answer, one reward (the docstring's strictness rule): a response's answer is decided from the
# response alone, so the golds it is paid for form one equivalence class. For every response and
# answer pair of every case file, the candidate golds are every box, every join of its last boxes,
# every math span and every number in it (and the case's gold); the ones paid must all be equivalent
# to one another. The one named exception is percent (departure 4): '7\%' is paid for 7 and 0.07.

RL = os.path.join(HERE, "data", "verify_rl.jsonl")
ASSERTS = os.path.join(HERE, "data", "verify_asserts.jsonl")
FAILCLOSED = os.path.join(HERE, "data", "verify_failclosed.jsonl")


def test_one_answer_one_reward_over_every_case_file():
    hedges, n_paid = [], 0
    for path in (CASES, FROZEN, OUTSIDE, HACKING, RL, ASSERTS, FAILCLOSED):
        for c in _load(path):
            hedge = B.hedge_of(c, B.judge_ours)
            if hedge is not None:
                hedges.append((os.path.basename(path), c.get("response", c.get("pred"))[:120], *hedge))
            n_paid += c["label"]
    assert n_paid > 1000, n_paid
    assert hedges == [], hedges


def test_the_hedge_check_finds_hedges():
    """hedge_of itself, on a judge that pays a suffix of a list (a reading that depends on the gold)."""
    def suffix_judge(c, gold=None):
        gold = c["gold"] if gold is None else gold
        boxes = [b for _, _, b in V._outer_boxes(c["response"])]
        return any(V.is_equivalent(", ".join(boxes[-k:]), gold) for k in range(1, len(boxes) + 1))
    c = {"response": "I tried $\\boxed{2}$; no, it is $\\boxed{9}$.", "gold": "9", "label": True}
    assert B.hedge_of(c, suffix_judge) == ("9", "2, 9")
    assert B.hedge_of(c, B.judge_ours) is None
    assert B.candidate_golds(c["response"]) == ["2", "9", "2, 9", "\\boxed{2}", "\\boxed{9}"]


def test_percent_is_the_one_dual_reading():
    assert V.verify("So $\\boxed{7\\%}$.", "7") == 1.0 and V.verify("So $\\boxed{7\\%}$.", "0.07") == 1.0
    assert B.percent_pair("7\\%", "7", "0.07") and not B.percent_pair("7", "7", "0.07")
    assert V.verify("So $\\boxed{7}$.", "0.07") == 0.0


def test_hedged_boxes_are_paid_for_one_gold_only():
    resp = "Checking each case: $\\boxed{2}$ $\\boxed{4}$ $\\boxed{6}$"
    assert [g for g in ("2", "4", "6", "4, 6", "2, 4, 6") if V.verify(resp, g)] == ["6"]
    resp = "I tried $\\boxed{2}$; no, it is $\\boxed{9}$."
    assert [g for g in ("2", "9", "2, 9") if V.verify(resp, g)] == ["9"]
    resp = "The answers are $\\boxed{2}, \\boxed{4}, \\boxed{6}$."
    assert [g for g in ("6", "4, 6", "2, 4, 6", "\\{2, 4, 6\\}") if V.verify(resp, g)] == ["2, 4, 6", "\\{2, 4, 6\\}"]
    for resp in ("<think>\\boxed{12}</think>", "<think>so \\boxed{12}", "<think>12</think>\n",
                 "<think>x</think> So $\\boxed{4}$ <think>\\boxed{12}</think>"):
        assert V.verify(resp, "12", strict=False) == 0.0, resp
    assert V.extract_answer("<think>x</think> So $\\boxed{4}$ <think>\\boxed{12}</think>") == "4"


# ------------------------------------------------------------------------------------------------
# The formats RL policies write and their near misses (data/verify_rl.jsonl, committed before
# the verifier changed for them): hedged boxes, words after a number, units of another size, boxes
# that are operands, hidden or disowned, left sides, numbers, answer cues in other scripts.

_RL = _load(RL)


def test_rl_file_shape():
    kinds = {}
    for c in _RL:
        assert "response" in c and isinstance(c["label"], bool), c
        kinds.setdefault(c["category"], set()).add(c["label"])
    assert sum(not c["label"] for c in _RL) >= 150 and sum(c["label"] for c in _RL) >= 60
    assert all(labels == {True, False} for labels in kinds.values()), kinds


@pytest.mark.parametrize("k", range(len(_RL)))
def test_rl_formats_and_kinds(k):
    c = _RL[k]
    assert _judge(c) is c["label"], c
    boxed = "\\boxed" in c["response"] or "\\fbox" in c["response"]
    assert V.verify(c["response"], c["gold"]) == float(c["label"] and boxed), c     # training: strict


def test_units_are_dropped_only_against_none_or_the_same():
    rows = [("5 \\text{ km}", "5", True), ("5 \\text{ km}", "5 \\text{ km}", True),
            ("5 \\text{ km}", "5 \\text{ m}", False), ("5 \\text{ kilometers}", "5 \\text{ km}", True),
            ("3 \\text{ hrs}", "3 \\text{ hours}", True), ("3 \\text{ min}", "3 \\text{ hours}", False),
            ("7 \\text{ cents}", "\\$7", False), ("7 \\text{ dollars}", "\\$7", True), ("\\$7", "7", True),
            ("30 \\text{ rad}", "30^\\circ", False), ("30 \\text{ degrees}", "30^\\circ", True),
            ("9 \\text{ cm}^2", "9 \\text{ m}^2", False), ("9 \\text{ m}^2", "9 \\text{ m}^2", True),
            ("7\\mathbb{N}", "7", False), ("7 \\text{ N}", "7", True), ("7 \\text{ thousand}", "7000", True),
            ("7 \\text{ thousand}", "7", False), ("7 \\text{ doubled}", "7", False),
            ("7 \\text{ onwards}", "7", False), ("7 \\text{ apples}", "7", True)]
    _check(rows)
    assert V._unit_of("5 \\text{ km}") == ("length", 1000.0) and V._unit_of("12 \\text{ apples}") is None
    assert V._unit_of("9 \\text{ cm}^2") == ("length^2", 1e-4) and V._unit_of("x^2") is None


def test_digits_and_marks_of_other_scripts():
    rows = [("４５", "45", True), ("٤٥", "45", True), ("⅞", "\\frac78", True), ("⅞", "78", False),
            ("2½", "\\frac52", True), ("10⁶", "10^6", True), ("10⁶", "106", False), ("1⁄2", "0.5", True),
            ("1\u202f000", "1000", True), ("{3 \\over 4}", "0.75", True), ("\\textcolor{red}{7}", "7", True),
            ("3.400,25", "3400.25", True), ("0.(3)", "\\frac13", True), ("0.(3)", "0", False),
            ("x \\equiv 7 \\pmod 1", "7", False), ("x \\equiv 7 \\pmod{10}", "7", True), ("7 + 0i", "7", True),
            ("7 = x", "7", True), ("x - x = 7", "7", False), ("7 + e^{-200}", "7", False)]
    _check(rows)
    assert V.extract_answer("所以他一共走了45公里。") == "45"
    assert V.extract_answer("答案是 45 或 46。") is None and V.extract_answer("答案不是45。") is None
    assert V.extract_answer("<think>7</think>\n<answer>15</answer>") == "15"
    assert V.extract_answer("<answer>15</answer>", strict=True) is None      # training: boxes only


def test_an_answer_hedged_or_continued_after_its_cue_or_box_is_none():
    none = ["The answer is $7$ or maybe $8$.", "所以 $x = 45$ 或 $46$。", "So $\\boxed{7}$ or 8.",
            "So $\\boxed{7}$ (or 8).",
            "$x \\ne \\boxed{7}$", "So $\\boxed{7} + \\boxed{1}$.", "So $2\\boxed{7}$.", "So $\\frac{\\boxed{7}}{2}$.",
            "The answer is \\boxed{5}!", "\\boxed{\\frac12} or 0.6", "2*\\boxed{7}", "\\boxed{7}-1", "\\boxed{7} - x",
            "\\boxed{7}(2)", "So $\\boxed{7}$ doubled.", "So $\\boxed{7}$ or more."]
    assert [r for r in none if V.extract_answer(r) is not None] == []
    # words around the box are prose: one answer is read without the gold, so they cannot buy a second value
    some = [("So $\\boxed{30}^\\circ$.", "30^\\circ"), ("We get $(\\boxed{7})$.", "7"), ("So $x = \\boxed{7}$.", "7"),
            ("The answer is $\\boxed{7}$ or $\\boxed{8}$.", "7, 8"), ("**Final Answer:** **\\boxed{7}**", "7"),
            ("It is not $\\boxed{7}$.", "7"), ("The answer is $7$ (wrong).", "7"),
            ("The answer is \\boxed{7} (from step 3).", "7"), ("The answer is $7$, since 3+4=7.", "7"),
            ("Answer: \\boxed{7} - Alice has 7 apples.", "7"), ("\\boxed{\\frac12}, or 0.5.", "\\frac12")]
    assert [(r, V.extract_answer(r)) for r, a in some if V.extract_answer(r) != a] == []


def test_odd_powers_of_a_negation():
    _check([("(b - t)^{7}", "(t - b)^{7}", False), ("-(b - t)^{7}", "(t - b)^{7}", True),
            ("(b - t)^{8}", "(t - b)^{8}", True), ("\\frac{3}{(b-t)^7}", "\\frac{3}{(t-b)^7}", False),
            ("y = (b-t)^7", "y = (t-b)^7", False), ("0.5(b-t)^7", "0.5(t-b)^7", False)])


SHARED = os.path.join(HERE, "..", "shared", "benchmarks")


@pytest.mark.skipif(not os.path.isdir(SHARED), reason="needs ../shared/benchmarks (MATH-500 and Minerva solutions)")
def test_worked_solutions_pay_their_own_gold():
    """Real worked solutions, read as responses as the trainer reads them (strict), are paid for their own gold:
    prose, figure code, remarks and units after the final box do not void it. MATH-500 499 of 500 and Minerva
    271 of 272 (the two left: '\\boxed{\\text{(B)}} 3(1 + r/10)^x = 7', a value continued; '= 0.012 R_\\odot', the
    same length restated in solar radii); `python -m bench.verify` prints them beside the hacks refused."""
    for name, tol in (("math500", V.DEFAULT_REL_TOL), ("minerva_math", V.MINERVA_REL_TOL)):
        rows = [json.loads(line) for line in open(os.path.join(SHARED, name + ".jsonl"), encoding="utf-8")]
        missed = [r["id"] for r in rows if V.verify(r["solution"], r["answer"], rel_tol=tol) != 1.0]
        assert len(rows) > 250 and len(missed) <= 1, (name, missed)


# ------------------------------------------------------------------------------------------------
# A response's answer is what it asserts (data/verify_asserts.jsonl, committed before the
# verifier changed for it): boxes their sentence does not assert, logic on boxes, qualifiers inside a
# box's text, chains and approximations whose sides disagree, exact tiny terms; each kind with controls.

_ASSERTS = _load(ASSERTS)


def test_asserts_file_shape():
    kinds = {}
    for c in _ASSERTS:
        assert "response" in c and isinstance(c["label"], bool), c
        kinds.setdefault(c["category"], set()).add(c["label"])
    assert sum(not c["label"] for c in _ASSERTS) >= 60 and sum(c["label"] for c in _ASSERTS) >= 50
    assert len(kinds) == 6 and all(True in labels for labels in kinds.values()), kinds
    # boxes their sentence does not assert are words around the box: paid for what the box holds, each saying why
    unasserted = [c for c in _ASSERTS if c["category"] == "box_not_asserted"]
    assert all(c["label"] and (c.get("reason") or "was" not in c) for c in unasserted)
    assert sum("source" in c for c in _ASSERTS) >= 20      # rows rewritten from other graders' normalisers


@pytest.mark.parametrize("k", range(len(_ASSERTS)))
def test_a_response_is_paid_for_what_it_asserts(k):
    c = _ASSERTS[k]
    assert _judge(c) is c["label"], c
    boxed = "\\boxed" in c["response"]
    assert V.verify(c["response"], c["gold"]) == float(c["label"] and boxed), c     # training: strict


def test_worked_solutions_that_say_would_or_if_stay_answers():
    """Sentences from MATH-500 and Minerva solutions that a first version of the assertion rule refused: the
    answer to a 'would' question, 'if and only if', an alternative method that 'could have' been used."""
    paid = [("Therefore, she would have saved $800 - 250 = \\boxed{550}$ gallons.", "550"),
            ("which is true if and only if $x\\ge \\frac{8+3}{2} = \\boxed{\\frac{11}{2}}$.", "\\frac{11}{2}"),
            ("We also could have noted that $\\tan A = \\boxed{2}$.", "2"),
            ("The temperature would have to be $\\boxed{5300}$ K.", "5300"),
            ("If $x = 3$, then $y = \\boxed{12}$.", "12"), ("Assuming $x > 0$, we get $x = \\boxed{12}$.", "12")]
    assert [r for r, g in paid if V.verify(r, g) != 1.0] == []
    # prose after the final box is allowed, however it reads; a second answer that differs, or logic on the box, is not
    hot = "The temperature would have to be $\\boxed{5300}$ K, about 4400 K above the melting point."
    assert V.extract_answer(hot) == "5300 \\text{ K}"
    assert [r for r in ("The total is $\\boxed{12}$. Is there a faster way? Yes: $3 \\cdot 4$.",
                        "The total is $\\boxed{12}$. It is the smallest such total.",
                        "The answer is $\\boxed{12}$. Let me double-check: $3 \\cdot 4 = 12$. Yes.",
                        "Were it $\\boxed{12}$, the sum would be odd.", "Is it $\\boxed{12}$?",
                        "So $\\boxed{12}$? Unsure.",
                        "The usual slip gives $\\boxed{12}$.", "So $\\boxed{12}$. On second thought, 13.")
            if V.extract_answer(r) != "12"] == []
    unpaid = ["So $\\boxed{12}$; the right answer is 13.", "So $\\boxed{12}$ $\\lor$ $\\boxed{13}$.",
              "So $\\lnot \\boxed{12}$.",
              "So $\\boxed{12}$ xor $\\boxed{13}$.", "So $\\boxed{12} \\mathrel{\\vee} \\boxed{13}$.",
              "So $\\boxed{12}$ - no wait, the answer is 13.", "So $\\boxed{12} \\land x > 0$.",
              "So $\\boxed{12}$.\n\nFinal Answer: The final answer is $13$. I hope it is correct."]
    assert [r for r in unpaid if V.extract_answer(r) is not None] == []
    assert V._in_math("So $x = \\boxed{1}$", 9) and not V._in_math("So $x$ is \\boxed{1}", 12)


def test_qualifiers_inside_a_box_text_and_unit_words():
    _check([("12 \\text{ or thirteen}", "12", False), ("12 \\text{ modulo five}", "12", False),
            ("\\text{about } 12", "12", False), ("12 \\text{ unverified}", "12", False),
            ("12 \\text{ square units}", "12", True), ("12 \\text{ units squared}", "12", True),
            ("12 \\text{ cm squared}", "12 \\text{ cm}^2", True), ("12 \\text{ cm squared}", "12 \\text{ m}^2", False),
            ("7 \\text{ squared}", "7", False), ("9.8\\,\\mathrm{m/s^2}", "9.8", True),
            ("\\text{A5}_{11}", "\\text{A5}_{11}", True), ("\\text{no solution}", "\\text{no solution}", True),
            ("x = 1 \\text{ or } x = 2", "1, 2", True), ("7 \\text{ (exactly)}", "7", True)])
    # fail closed: words the unit tables do not hold make the answer unequal unless the gold carries them too
    _check([("12 \\text{ give or take}", "12", False), ("12 \\text{ give or take}", "12 \\text{ give or take}", True),
            ("\\text{Area} = 50", "50", True), ("7^{\\text{th}}", "7", True), ("\\mathrm{lcm}(3,5)", "15", True)])
    assert V._unknown_units("\\begin{cases} 1 & \\text{if } x > 0 \\\\ 0 & \\text{otherwise} \\end{cases}") == ""


def test_chains_whose_sides_disagree_state_nothing():
    _check([("\\int_0^1 2x\\,dx = 1 = 12", "12", False), ("\\int_0^1 2x\\,dx = 1 = 12", "1", False),
            ("\\int_0^1 2x\\,dx = \\frac{2}{2} = 1", "1", True),
            ("\\lim_{x \\to 0} \\frac{\\sin x}{x} = 1", "1", True),
            ("y \\approx 11.46 \\approx 11.5 \\approx 12", "12", False),
            ("y \\approx 11.46 \\approx 11.5", "11.5", True),
            ("t \\approx 2.449 \\approx 2.4", "2.4", True), ("x = \\sqrt{6} \\approx 2.45 \\approx 2.5", "2.5", False)])
    assert V._sides_after_unparsed("\\int_0^1 x\\,dx = \\frac12 = 0.5") == ["\\frac12", "0.5"]
    lo, hi = V._approx_span(V._parse("11.46", V._Budget(), as_gold=False), V._Budget())
    assert abs(float(lo) - 11.455) < 1e-9 and abs(float(hi) - 11.465) < 1e-9


def test_exact_terms_beyond_the_working_precision_are_limit_hits():
    V.reset_stats()
    assert not V.is_equivalent("\\pi + 10^{-60}", "\\pi") and not V.is_equivalent("\\pi(1 + 10^{-60})", "\\pi")
    assert V.stats()["limit_hits"] == 2
    assert V.is_equivalent("(10^{45} + \\pi, 1 + \\sqrt{2})", "(10^{45} + \\pi, 1 + \\sqrt{2})")   # a scale per sum
    assert V.is_equivalent("12 + 10^{-60}", "\\frac{12 \\cdot 10^{60} + 1}{10^{60}}")                # exact: exact
    assert not V.is_equivalent("12 + 0.00001", "12") and not V.is_equivalent("\\pi + 0.00001", "\\pi")  # a decimal term
    assert V.is_equivalent("3.1416 r^2", "\\pi r^2") and V.is_equivalent("12 + 0.00001 - 0.00001", "12")
    assert V.is_equivalent("\\frac{\\pi}{10^{60}}", "10^{-60}\\pi") and V.is_equivalent("2^{100}\\pi", "2^{100}\\pi")
    from fractions import Fraction
    assert V._carried(Fraction(1, 3)) == Fraction(1, 3) and V._carried(Fraction(2 ** 100)) == 2 ** 100
    for v in (Fraction(10 ** 60 + 1, 10 ** 60), Fraction(3 ** 100)):
        with pytest.raises(V._Limit):
            V._carried(v)



def test_unboxed_answers_follow_the_same_sentence_rule():
    """Without a box (evaluation, strict=False), an answer cue's math and the last math span are read under the
    same rule: a sentence that does not assert its value gives no answer, and no last number is tried after it."""
    none = ["Were it $12$, the sum would be odd.", "The usual slip gives $12$.", "The answer is $12$ if n is even.",
            "The answer is $12$. I am not sure this is right."]
    assert [r for r in none if V.extract_answer(r) is not None] == []
    assert V.verify("So the answer is 12? Unsure.", "12", strict=False) == 0.0     # a '?' line is read whole
    assert [r for r in ("Thus the answer is 12 if n is even.", "Thus the answer is 12, probably.")
            if V.verify(r, "12", strict=False)] == []
    assert V.verify("Thus the answer is 12.", "12", strict=False) == 1.0
    some = [("We have $3\\cdot 4=12$ apples.\nFinal Answer: The final answer is $12$. I hope it is correct.", "12"),
            ("If $x = 3$, then $y = 12$.", "y = 12")]
    assert V.extract_answer("The answer is $12$, since $n$ is even.") == "12"    # prose after a cue's math
    assert [(r, V.extract_answer(r)) for r, a in some if V.extract_answer(r) != a] == []


# ------------------------------------------------------------------------------------------------
# The reward fails closed (data/verify_failclosed.jsonl, committed before verify.py changed for it):
# after the final box only closing marks; unknown units, percent on both sides, degrees against radians,
# exact decimals, moduli and piecewise forms are unequal unless shown equal.

_FAILCLOSED = _load(FAILCLOSED)


_OWN = [c for c in _FAILCLOSED if not c["category"].startswith("outside_")]
_OUTSIDE = [c for c in _FAILCLOSED if c["category"].startswith("outside_")]


def test_failclosed_file_shape():
    kinds = {}
    for c in _FAILCLOSED:
        assert "response" in c and isinstance(c["label"], bool) and c.get("source"), c
        kinds.setdefault(c["category"], 0)
        kinds[c["category"]] += 1
    assert sum(not c["label"] for c in _OWN) >= 90 and sum(c["label"] for c in _OWN) >= 70
    assert all(not c["label"] or "was" in c for c in _OWN if c["category"] != "control")   # relabelled: 'was'
    assert all(c.get("reason") for c in _FAILCLOSED if "was" in c)       # a relabelled row says why
    assert sum(k.startswith("position_") for k in kinds) >= 9 and sum(k.startswith("value_") for k in kinds) >= 7
    assert len(_OUTSIDE) >= 100 and all(c.get("note") for c in _OUTSIDE)  # taken from other projects, each with a note


@pytest.mark.parametrize("k", range(len(_OWN)))
def test_a_response_is_paid_only_for_what_it_holds_closed(k):
    c = _OWN[k]
    assert _judge(c) is c["label"], c
    boxed = "\\boxed" in c["response"]       # training (strict) pays boxed answers only
    tol = c.get("rel_tol", V.DEFAULT_REL_TOL)
    assert V.verify(c["response"], c["gold"], rel_tol=tol) == float(c["label"] and boxed), c


def test_outside_responses_honest_paid_and_wrong_refused():
    """Responses taken from other projects (committed before the tail rule changed, labelled by reading): both sides
    of the trade in one count. Every wrong value and second answer is refused; the honest ones paid but three
    (a multi-part answer with words between its boxes, the two worked solutions above)."""
    honest = [c for c in _OUTSIDE if c["label"]]
    missed = [c["response"][-80:] for c in honest if V.verify(c["response"], c["gold"]) != 1.0]
    paid = [c["response"][-80:] for c in _OUTSIDE if not c["label"] and V.verify(c["response"], c["gold"]) == 1.0]
    assert len(honest) >= 85 and len(missed) <= 3 and paid == [], (missed, paid)


def test_the_trade_table_counts_both_sides(capsys):
    """bench.verify's trade table against a direct count of the same rows (strict=True, as the trainer scores)."""
    rows = {what: (n, ours) for what, n, ours, theirs in B.trade([FAILCLOSED], None)}
    own = [c for c in _OWN if "response" in c]
    paid = sum(V.verify(c["response"], c["gold"], rel_tol=c.get("rel_tol", V.DEFAULT_REL_TOL)) == 1.0
               for c in own if c["label"] and "\\boxed" in c["response"])
    refused = sum(V.verify(c["response"], c["gold"]) == 0.0 for c in own if not c["label"])
    assert rows["paid: verify_failclosed.jsonl boxed controls"] == (
        sum(c["label"] and "\\boxed" in c["response"] for c in own), paid)
    assert rows["refused: verify_failclosed.jsonl must score 0"] == (sum(not c["label"] for c in own), refused)
    n_out = sum(not c["label"] for c in _OUTSIDE)
    assert rows["refused: verify_failclosed.jsonl (outside rows) must score 0"] == (n_out, n_out)
    assert "honest answers paid beside hacks refused" in capsys.readouterr().out


def test_against_names_what_the_tail_rule_refused():
    """bench.verify against's reasons for a refused box, one per kind."""
    kinds = {"So \\boxed{12}.5": "the value continued", "So \\boxed{12}. Answer: 15": "an answer statement",
             "So \\boxed{12} = 15": "a restatement", "So -\\boxed{12}": "operand", "no box here": "no box"}
    assert {t: k for t, k in kinds.items() if k not in B._tail_kind(t)} == {}


def test_the_tail_rule():
    """After the final box: prose passes; a value continued, or a second final answer that differs, does not."""
    same = "12"
    prose = ["", ".", " .\n\n", "$.", "<|im_end|>", " I hope it is correct.", " ways to seat them.", " is our answer.",
             ". Note that $7$ is prime.", "\n[asy]\nlabel(\"$15$\",(0,0));\n[/asy]", " ✓", ", i.e. twelve",
             " (checked)",
             "\n\nFinal Answer: The final answer is $12$. I hope it is correct.", "\n\n#### 12", " = 12", ", or $12$.",
             ". We may check our answer: $3 \\cdot 4 = 12$.", " \\pm 5730 years", "}", " hmm", "</reasoning>",
             ". My classmate says 15.", "。不对，应该是15。", "\n15", "\n\nThe answer is not 15: 15 is odd.",
             ", and the sum is 7.", "\n\nThe result is 15 when n = 3.", " (that is, 12 people)", " = 12.0",
             "; 5 is odd, so it is not 5.", ", or \\text{twelve}"]
    refused = [".5", "^2", "0", "!", "'", " 15", "\\,000", "{,}000", " million", " dozen", " + 3", "\\times 10^3", "i",
               "(2)", " \\pm \\sqrt{2}", " doubled", " or more", " \\lor x", ", 15", " and 15", " -> 15", " = 15",
               ", i.e. $13$", " (or 15)", " or maybe $8$", "\n\nAnswer: 15", "\nThe answer is $15$.", " #### 15",
               ". Correction: 15", "\n\\textbf{Answer:} 15", "。不，答案是15。", "\nFinal Answer: 12 or 13",
               "\nThe correct answer is 15 apples.", ". The answer is actually 15.", "\nThe answer should be 15",
               "\n\nFinal answer 15", "\n\nAns: 15", "\nSo the final result is 15.", " = 12.5", "; 15",
               " \\text{ or } 15", ". Final: 15", "\n\nResult: 15"]
    # at most _MAX_STATED answer statements are read (each is a comparison): more make no answer
    assert V._tail_agrees("\nAnswer: 12" * V._MAX_STATED, "12") and not V._tail_agrees("\nAnswer: 12" * 9, "12")
    # a decimal restated after an exact value agrees when it rounds it (within 1%)
    assert V._tail_agrees(" = 0.333...", "\\frac13") and not V._tail_agrees(" = 0.35", "\\frac13")
    assert [t for t in prose if not V._tail_agrees(t, same)] == []
    assert [t for t in refused if V._tail_agrees(t, same)] == []
    assert V.extract_answer("So $\\textcolor{red}{\\boxed{7}}$.") == "7"
    assert V.extract_answer("So \\boxed{1.6} \\mathrm{~cm}.") == "1.6 \\text{ cm}"   # a unit the parser reads joins
    # one it cannot read is context
    assert V.extract_answer("So \\boxed{11000} \\mathrm{kcal} \\mathrm{m}^{-2} \\mathrm{yr}^{-1}.") == "11000"
    assert V.extract_answer("So \\boxed{12} dozen.") is None and V.extract_answer("So \\boxed{12} MHz.") == "12"
    assert V.extract_answer("So $\\boxed{3} \\pmod{7}$.") == "3\\pmod{7}"
    # a next turn after the box ends the response there: a box in the made-up turn is never the answer
    assert V.extract_answer("So \\boxed{12}.\n\nQuestion: what is 3+4?\nAnswer: \\boxed{7}") == "12"
    assert V.extract_answer("So \\boxed{12}.\nUser: sure?\nAssistant: \\boxed{7}") == "12"
    assert V.extract_answer("So \\boxed{12}.\n\nYour turn: compute 3+4 as $\\boxed{[answer]}$.") == "12"
    # without a box a base model's next few-shot problem is still cut after its answer cue
    assert V.extract_answer("Final Answer: The final answer is $2$.\n\nProblem:\nFind $z$.\n") == "2"


def test_value_rules_fail_closed():
    _check([("12 \\text{ MHz}", "12 \\text{ Hz}", False), ("12 \\text{ MHz}", "12", False),
            ("12 \\text{ MHz}", "12 \\text{ MHz}", True), ("12", "12 \\text{ MHz}", True),
            ("12 \\text{ cm}", "12", True), ("12 \\text{ kJ}", "12 \\text{ J}", False),
            ("7 \\text{ dozen}", "84", True), ("1 \\text{ or } -2", "1, -2", True),                 # known words
            ("0.12\\%", "12\\%", False), ("1200\\%", "12\\%", False), ("12\\%", "12\\%", True),
            ("12\\%", "0.12", True), ("0.12", "12\\%", True), ("12\\%", "12", True),            # one side: dual
            ("\\frac{\\pi}{6}^\\circ", "\\frac{\\pi}{6}", False), ("\\pi^{\\circ}", "\\pi", False),
            ("30^\\circ", "30", True), ("\\sin 30^\\circ", "\\sin\\frac{\\pi}{6}", True),
            ("0.50004", "0.5", False), ("2.2501", "2.25", False), ("0.50", "0.5", True), ("\\frac12", "0.5", True),
            ("1.4142", "\\sqrt2", True), ("0.8333", "\\frac56", True),
            ("x \\equiv 2 \\pmod{7}", "x \\equiv 2 \\pmod{5}", False), ("2 \\pmod 5", "2 \\pmod{5}", True),
            ("x \\equiv 2 \\pmod{5}", "2", True),
            ("\\min(x, 1000)", "x", False), ("\\max(x, -1000)", "x", False), ("\\min(x^2, 10^6)", "x^2", False),
            ("\\max(x, 0.01)", "x", False), ("\\lfloor x \\rfloor + (x - \\lfloor x \\rfloor)", "x", True),
            ("\\min(x, y) + \\max(x, y)", "x + y", True), ("e^{\\ln x}", "x", True), ("\\sqrt{x^2}", "|x|", True)])
    assert V.is_equivalent("4.46e19", "4.5e19", rel_tol=V.MINERVA_REL_TOL)       # Minerva's golds are rounded
    assert V._unknown_units("12 \\text{ MHz}") == "mhz" and V._unknown_units("12 \\text{ square units}") == ""
    names = ["x"]
    wide = V._wide_points(names)[1:]
    xs = [p["x"] for p in wide]
    assert min(map(abs, xs)) < 0.1 and max(xs) > 1000 and min(xs) < -1000

