//! The parser of the text format: a small lexer and a recursive-descent parser that
//! resolves value names as it goes. Errors carry line and column (1-based, in characters), what was
//! expected and what was found. No input makes it panic.

use rustc_hash::FxHashMap as HashMap;
use std::fmt;

use crate::{Arg, Builtin, BuiltinArg, BuiltinParam, Graph, NodeKind, ValueId};
use ir_core::op::Overload;
use ir_core::{DType, Device, Layout, TensorMeta};

/// A syntax or name-resolution error, displayed like `3:17: expected ',' or ')', found 'x'`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{line}:{column}: expected {expected}, found {found}")]
pub struct ParseError {
    /// 1-based line.
    pub line: u32,
    /// 1-based column, in characters.
    pub column: u32,
    /// What the parser expected.
    pub expected: String,
    /// What it found.
    pub found: String,
}

/// Parses one graph.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let tokens = lex(text)?;
    let mut parser = Parser { tokens, pos: 0, names: HashMap::default() };
    parser.graph()
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Value(String),
    Int(i64),
    Float(f64),
    Str(String),
    Punct(char),
    Eof,
}

impl fmt::Display for Tok {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "'{s}'"),
            Tok::Value(s) => write!(f, "'%{s}'"),
            Tok::Int(v) => write!(f, "'{v}'"),
            Tok::Float(v) => write!(f, "'{}'", crate::print::format_float(*v)),
            Tok::Str(s) => write!(f, "'\"{s}\"'"),
            Tok::Punct(c) => write!(f, "'{c}'"),
            Tok::Eof => f.write_str("end of input"),
        }
    }
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: u32,
    column: u32,
}

fn lex(text: &str) -> Result<Vec<Token>, ParseError> {
    let chars: Vec<char> = text.chars().collect();
    let mut tokens = Vec::new();
    let (mut i, mut line, mut column) = (0usize, 1u32, 1u32);
    let error =
        |line, column, expected: &str, found: String| ParseError { line, column, expected: expected.to_owned(), found };
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            i += 1;
            line += 1;
            column = 1;
            continue;
        }
        if c.is_whitespace() {
            i += 1;
            column += 1;
            continue;
        }
        if c == '/' && chars.get(i + 1) == Some(&'/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
            continue;
        }
        let (start_line, start_column) = (line, column);
        let start = i;
        let tok = if c.is_ascii_alphabetic() || c == '_' {
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            Tok::Ident(chars[start..i].iter().collect())
        } else if c == '%' {
            i += 1;
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '.') {
                i += 1;
            }
            if i == start + 1 {
                let found = chars.get(i).map_or("end of input".to_owned(), |c| format!("'{c}'"));
                return Err(error(start_line, start_column + 1, "a value name after '%'", found));
            }
            Tok::Value(chars[start + 1..i].iter().collect())
        } else if c.is_ascii_digit() || (c == '-' && chars.get(i + 1).is_some_and(|n| n.is_ascii_digit() || *n == 'i'))
        {
            i += 1;
            if c == '-' && chars[i] == 'i' {
                let word: String = chars[i..(i + 3).min(chars.len())].iter().collect();
                if word != "inf" {
                    return Err(error(start_line, start_column, "a number", format!("'-{word}'")));
                }
                i += 3;
                Tok::Float(f64::NEG_INFINITY)
            } else {
                let mut is_float = false;
                while i < chars.len() {
                    let d = chars[i];
                    let exponent_sign = (d == '-' || d == '+') && matches!(chars[i - 1], 'e' | 'E');
                    if d.is_ascii_digit() || exponent_sign {
                        i += 1;
                    } else if d == '.' || d == 'e' || d == 'E' {
                        is_float = true;
                        i += 1;
                    } else {
                        break;
                    }
                }
                let literal: String = chars[start..i].iter().collect();
                if is_float {
                    let value = literal
                        .parse::<f64>()
                        .map_err(|_| error(start_line, start_column, "a number", format!("'{literal}'")))?;
                    Tok::Float(value)
                } else {
                    let value = literal.parse::<i64>().map_err(|_| {
                        error(start_line, start_column, "an integer that fits in 64 bits", format!("'{literal}'"))
                    })?;
                    Tok::Int(value)
                }
            }
        } else if c == '"' {
            // A string argument: no escapes, so no quote, backslash or line break inside.
            i += 1;
            while i < chars.len() && chars[i] != '"' && chars[i] != '\\' && chars[i] != '\n' {
                i += 1;
            }
            if chars.get(i) != Some(&'"') {
                let found = chars.get(i).map_or("end of input".to_owned(), |c| format!("{c:?}"));
                return Err(error(start_line, start_column, "a closing '\"' (strings have no escapes)", found));
            }
            i += 1;
            Tok::Str(chars[start + 1..i - 1].iter().collect())
        } else if "(){}[],:=+@.".contains(c) {
            i += 1;
            Tok::Punct(c)
        } else {
            return Err(error(start_line, start_column, "a token", format!("'{c}'")));
        };
        column += (i - start) as u32;
        tokens.push(Token { tok, line: start_line, column: start_column });
    }
    tokens.push(Token { tok: Tok::Eof, line, column });
    Ok(tokens)
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    names: HashMap<String, ValueId>,
}

impl Parser {
    fn peek(&self) -> &Token {
        &self.tokens[self.pos.min(self.tokens.len() - 1)]
    }

    fn next(&mut self) -> Token {
        let token = self.peek().clone();
        if self.pos < self.tokens.len() - 1 {
            self.pos += 1;
        }
        token
    }

    fn error_at(&self, token: &Token, expected: &str) -> ParseError {
        ParseError {
            line: token.line,
            column: token.column,
            expected: expected.to_owned(),
            found: token.tok.to_string(),
        }
    }

    fn expect_punct(&mut self, c: char, expected: &str) -> Result<Token, ParseError> {
        let token = self.next();
        if token.tok == Tok::Punct(c) {
            return Ok(token);
        }
        Err(self.error_at(&token, expected))
    }

    fn eat_punct(&mut self, c: char) -> bool {
        if self.peek().tok == Tok::Punct(c) {
            self.next();
            return true;
        }
        false
    }

    fn ident(&mut self, expected: &str) -> Result<(String, Token), ParseError> {
        let token = self.next();
        match &token.tok {
            Tok::Ident(name) => Ok((name.clone(), token)),
            _ => Err(self.error_at(&token, expected)),
        }
    }

    fn keyword(&mut self, word: &str) -> Result<(), ParseError> {
        let token = self.next();
        match &token.tok {
            Tok::Ident(name) if name == word => Ok(()),
            _ => Err(self.error_at(&token, &format!("'{word}'"))),
        }
    }

    fn int(&mut self, expected: &str) -> Result<i64, ParseError> {
        let token = self.next();
        match token.tok {
            Tok::Int(v) => Ok(v),
            _ => Err(self.error_at(&token, expected)),
        }
    }

    fn usize(&mut self, expected: &str) -> Result<usize, ParseError> {
        let token = self.peek().clone();
        let value = self.int(expected)?;
        usize::try_from(value).map_err(|_| self.error_at(&token, expected))
    }

    fn graph(&mut self) -> Result<Graph, ParseError> {
        self.keyword("graph")?;
        let (name, _) = self.ident("a graph name")?;
        let mut graph = Graph::new(name);
        self.expect_punct('(', "'('")?;
        if !self.eat_punct(')') {
            loop {
                self.input(&mut graph)?;
                if self.eat_punct(')') {
                    break;
                }
                self.expect_punct(',', "',' or ')'")?;
            }
        }
        self.expect_punct('{', "'{'")?;
        while !self.eat_punct('}') {
            self.statement(&mut graph)?;
        }
        let token = self.next();
        if token.tok != Tok::Eof {
            return Err(self.error_at(&token, "end of input"));
        }
        Ok(graph)
    }

    fn input(&mut self, graph: &mut Graph) -> Result<(), ParseError> {
        let token = self.next();
        let Tok::Value(name) = token.tok.clone() else { return Err(self.error_at(&token, "an input name like '%x'")) };
        self.expect_punct(':', "':'")?;
        let meta = self.ty()?;
        let value = graph.add_input(name.clone(), meta);
        let node = graph.value(value).def;
        graph.node_mut(node).location = Some((token.line, token.column));
        if matches!(&self.peek().tok, Tok::Ident(word) if word == "donated") {
            self.next();
            graph.mark_donated(&name);
        }
        self.define(graph, &name, value, &token)
    }

    fn define(&mut self, graph: &mut Graph, name: &str, value: ValueId, token: &Token) -> Result<(), ParseError> {
        if self.names.insert(name.to_owned(), value).is_some() {
            return Err(ParseError {
                line: token.line,
                column: token.column,
                expected: "a new value name".to_owned(),
                found: format!("duplicate name '%{name}'"),
            });
        }
        graph.note_name(name);
        Ok(())
    }

    fn use_value(&mut self) -> Result<ValueId, ParseError> {
        let token = self.next();
        let Tok::Value(name) = &token.tok else { return Err(self.error_at(&token, "a value like '%x'")) };
        self.names.get(name).copied().ok_or_else(|| ParseError {
            line: token.line,
            column: token.column,
            expected: "a defined value".to_owned(),
            found: format!("undefined value '%{name}'"),
        })
    }

    fn statement(&mut self, graph: &mut Graph) -> Result<(), ParseError> {
        let start = self.peek().clone();
        let location = Some((start.line, start.column));
        if matches!(&start.tok, Tok::Ident(word) if word == "output") {
            self.next();
            self.expect_punct('(', "'('")?;
            let mut values = Vec::new();
            if !self.eat_punct(')') {
                loop {
                    values.push(self.use_value()?);
                    if self.eat_punct(')') {
                        break;
                    }
                    self.expect_punct(',', "',' or ')'")?;
                }
            }
            graph.insert_named(NodeKind::Output(values), Vec::new(), None, location);
            return Ok(());
        }
        let mut results = Vec::new();
        loop {
            let token = self.next();
            let Tok::Value(name) = &token.tok else {
                return Err(self.error_at(&token, "a result like '%0' or 'output'"));
            };
            results.push((name.clone(), token.clone()));
            if self.eat_punct('=') {
                break;
            }
            self.expect_punct(',', "',' or '='")?;
        }
        let kind = self.expr(graph)?;
        let token = self.expect_punct(':', "':' and the result types")?;
        let mut types = vec![self.ty()?];
        while self.eat_punct(',') {
            types.push(self.ty()?);
        }
        if types.len() != results.len() {
            return Err(ParseError {
                line: token.line,
                column: token.column,
                expected: format!("{} result type(s)", results.len()),
                found: format!("{} type(s)", types.len()),
            });
        }
        let named = results.iter().map(|(name, _)| name.clone()).zip(types).collect();
        let (_, values) = graph.insert_named(kind, named, None, location);
        for ((name, token), value) in results.iter().zip(values) {
            self.define(graph, name, value, token)?;
        }
        Ok(())
    }

    fn expr(&mut self, graph: &mut Graph) -> Result<NodeKind, ParseError> {
        let (name, token) = self.ident("an op, 'impl' or a built-in")?;
        if name == "impl" {
            let (op, _) = self.ident("an op name")?;
            self.expect_punct('[', "'['")?;
            let (provider, _) = self.ident("a provider name")?;
            self.expect_punct(']', "']'")?;
            let mut writes = Vec::new();
            if matches!(&self.peek().tok, Tok::Ident(word) if word == "writes") {
                self.next();
                self.expect_punct('(', "'('")?;
                loop {
                    writes.push(self.usize("a parameter position")?);
                    if self.eat_punct(')') {
                        break;
                    }
                    self.expect_punct(',', "',' or ')'")?;
                }
            }
            let args = self.args()?;
            let (op, provider) = (graph.op_ref(&op), graph.provider_ref(&provider));
            return Ok(NodeKind::ImplCall { op, provider, writes, args: args.into_iter().map(|(a, _)| a).collect() });
        }
        if let Some(op) = Builtin::from_name(&name) {
            let args = self.args()?;
            return builtin(op, args, &token);
        }
        let mut overload = Overload::Default;
        if self.eat_punct('.') {
            self.keyword("maybe_inplace")?;
            overload = Overload::MaybeInplace;
        }
        let args = self.args()?;
        Ok(NodeKind::IrCall { op: graph.op_ref(&name), overload, args: args.into_iter().map(|(a, _)| a).collect() })
    }

    fn args(&mut self) -> Result<Vec<(Arg, Token)>, ParseError> {
        self.expect_punct('(', "'('")?;
        let mut args = Vec::new();
        if self.eat_punct(')') {
            return Ok(args);
        }
        loop {
            let token = self.peek().clone();
            let arg = match &token.tok {
                Tok::Value(_) => Arg::Value(self.use_value()?),
                Tok::Ident(word) => {
                    self.next();
                    match word.as_str() {
                        "none" => Arg::None,
                        "true" => Arg::Bool(true),
                        "false" => Arg::Bool(false),
                        "inf" => Arg::F64(f64::INFINITY),
                        "nan" => Arg::F64(f64::NAN),
                        other => match other.parse::<DType>() {
                            Ok(dtype) => Arg::DType(dtype),
                            Err(_) => return Err(self.error_at(&token, "an argument")),
                        },
                    }
                }
                Tok::Int(v) => {
                    self.next();
                    Arg::I64(*v)
                }
                Tok::Float(v) => {
                    self.next();
                    Arg::F64(*v)
                }
                Tok::Str(v) => {
                    self.next();
                    Arg::Str(v.clone())
                }
                Tok::Punct('[') => {
                    self.next();
                    let mut values = Vec::new();
                    if !self.eat_punct(']') {
                        loop {
                            values.push(self.int("an integer")?);
                            if self.eat_punct(']') {
                                break;
                            }
                            self.expect_punct(',', "',' or ']'")?;
                        }
                    }
                    Arg::Ints(values)
                }
                _ => return Err(self.error_at(&token, "an argument")),
            };
            args.push((arg, token));
            if self.eat_punct(')') {
                return Ok(args);
            }
            self.expect_punct(',', "',' or ')'")?;
        }
    }

    fn ty(&mut self) -> Result<TensorMeta, ParseError> {
        let (name, token) = self.ident("a dtype (f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8, i64)")?;
        let dtype: DType = name
            .parse()
            .map_err(|_| self.error_at(&token, "a dtype (f32, f16, bf16, f64, f8e4m3fn, f8e5m2, i8, i64)"))?;
        let shape = self.dims('[', ']')?;
        let strides = if self.peek().tok == Tok::Punct('{') { Some(self.dims('{', '}')?) } else { None };
        let offset = if self.eat_punct('+') { self.usize("a storage offset")? } else { 0 };
        let mut device = Device::Cpu;
        if self.eat_punct('@') {
            let (kind, kind_token) = self.ident("a device (cpu, cuda:N, rocm:N, xpu:N)")?;
            let spelled = if kind == "cpu" {
                kind
            } else {
                self.expect_punct(':', "':' and a device index")?;
                format!("{kind}:{}", self.usize("a device index")?)
            };
            device =
                spelled.parse().map_err(|_| self.error_at(&kind_token, "a device (cpu, cuda:N, rocm:N, xpu:N)"))?;
        }
        let strides = strides.unwrap_or_else(|| ir_core::layout::compact_strides(&shape));
        let layout = Layout::new(&shape, &strides, offset).map_err(|e| ParseError {
            line: token.line,
            column: token.column,
            expected: "a valid layout".to_owned(),
            found: e.to_string(),
        })?;
        let meta = TensorMeta { dtype, device, layout };
        if meta.storage_bytes().is_none() {
            return Err(ParseError {
                line: token.line,
                column: token.column,
                expected: "a tensor of at most isize::MAX bytes".to_owned(),
                found: meta.to_string(),
            });
        }
        Ok(meta)
    }

    fn dims(&mut self, open: char, close: char) -> Result<Vec<usize>, ParseError> {
        self.expect_punct(open, &format!("'{open}'"))?;
        let mut dims = Vec::new();
        if self.eat_punct(close) {
            return Ok(dims);
        }
        loop {
            dims.push(self.usize("a non-negative integer")?);
            if self.eat_punct(close) {
                return Ok(dims);
            }
            self.expect_punct(',', &format!("',' or '{close}'"))?;
        }
    }
}

/// Converts a built-in's positional arguments into its node kind, with the arity and the argument
/// kinds from the built-in table.
fn builtin(op: Builtin, args: Vec<(Arg, Token)>, at: &Token) -> Result<NodeKind, ParseError> {
    let params = op.def().params;
    if args.len() != params.len() {
        return Err(ParseError {
            line: at.line,
            column: at.column,
            expected: format!("{} argument(s) for {}", params.len(), op.signature()),
            found: format!("{} argument(s)", args.len()),
        });
    }
    args.into_iter()
        .zip(params)
        .map(|((arg, token), param)| {
            let converted = match (arg, param) {
                (Arg::Value(v), BuiltinParam::Value) => Some(BuiltinArg::Value(v)),
                (Arg::I64(v), BuiltinParam::Index) => usize::try_from(v).ok().map(BuiltinArg::Index),
                (Arg::Ints(dims), BuiltinParam::Shape) => {
                    dims.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<Vec<_>>>().map(BuiltinArg::Shape)
                }
                (Arg::F64(v), BuiltinParam::Float) => Some(BuiltinArg::Float(v)),
                _ => None,
            };
            converted.ok_or_else(|| {
                let what = match param {
                    BuiltinParam::Value => "a value",
                    BuiltinParam::Index => "a non-negative integer",
                    BuiltinParam::Shape => "a list of non-negative integers",
                    BuiltinParam::Float => "a float",
                };
                ParseError {
                    line: token.line,
                    column: token.column,
                    expected: format!("{what} ({} takes {})", op.name(), op.signature()),
                    found: token_text(&token),
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()
        .map(|args| NodeKind::Builtin { op, args })
}

fn token_text(token: &Token) -> String {
    token.tok.to_string()
}
