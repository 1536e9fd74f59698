//! The parser of the text format: a small lexer and a recursive-descent parser that
//! resolves value names as it goes. Errors carry line and column (1-based, in characters), what was
//! expected and what was found. No input makes it panic.

use rustc_hash::FxHashMap as HashMap;
use std::fmt;

use crate::{Arg, Builtin, BuiltinArg, BuiltinParam, Graph, NodeKind, SourceLocation, ValueId};
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

/// Parses one graph. The text is read once, front to back: tokens are produced on demand and borrow
/// from it, so parsing needs no memory beyond the graph itself and the table of names in scope.
pub fn parse(text: &str) -> Result<Graph, ParseError> {
    let mut lexer = Lexer { text, bytes: text.as_bytes(), i: 0, line: 1, column: 1 };
    let (current, pending) = match lexer.token() {
        Ok(token) => (token, None),
        Err(error) => (Token { tok: Tok::Bad, line: error.line, column: error.column }, Some(error)),
    };
    let mut parser = Parser { lexer, current, pending, names: HashMap::default() };
    parser.graph()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tok<'a> {
    Ident(&'a str),
    Value(&'a str),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Punct(char),
    Eof,
    /// Where the text could not be read as a token; the parser reports the lexer's error there.
    Bad,
}

impl fmt::Display for Tok<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Tok::Ident(s) => write!(f, "'{s}'"),
            Tok::Value(s) => write!(f, "'%{s}'"),
            Tok::Int(v) => write!(f, "'{v}'"),
            Tok::Float(v) => write!(f, "'{}'", crate::print::format_float(*v)),
            Tok::Str(s) => write!(f, "'\"{s}\"'"),
            Tok::Punct(c) => write!(f, "'{c}'"),
            Tok::Eof => f.write_str("end of input"),
            Tok::Bad => f.write_str("an unreadable token"),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Token<'a> {
    tok: Tok<'a>,
    line: u32,
    column: u32,
}

/// Splits the text into tokens one at a time. Positions are bytes; columns count characters (only
/// strings, comments and errors hold non-ASCII text).
struct Lexer<'a> {
    text: &'a str,
    bytes: &'a [u8],
    i: usize,
    line: u32,
    column: u32,
}

fn lex_error(line: u32, column: u32, expected: &str, found: String) -> ParseError {
    ParseError { line, column, expected: expected.to_owned(), found }
}

/// A character as an error names it: a visible one quoted, a byte-order mark by name, any other
/// invisible one (control, space, zero-width) by its code point.
fn describe_char(c: char) -> String {
    let invisible = c.is_control()
        || c.is_whitespace()
        || matches!(c, '\u{200b}'..='\u{200f}' | '\u{2060}'..='\u{2064}' | '\u{00ad}');
    match c {
        '\u{feff}' => "a byte-order mark (U+FEFF; save the file without one)".to_owned(),
        c if invisible => format!("the invisible character U+{:04X}", u32::from(c)),
        c => format!("'{c}'"),
    }
}

impl<'a> Lexer<'a> {
    /// The character at byte `i`, if any.
    fn char_at(&self, i: usize) -> Option<char> {
        self.text.get(i..).and_then(|rest| rest.chars().next())
    }

    fn byte_at(&self, i: usize) -> Option<u8> {
        self.bytes.get(i).copied()
    }

    /// Moves past `len` bytes that hold `chars` characters on the current line.
    fn advance(&mut self, len: usize, chars: usize) {
        self.i += len;
        self.column += chars as u32;
    }

    fn skip_while(&mut self, mut keep: impl FnMut(u8) -> bool) {
        while self.i < self.bytes.len() && keep(self.bytes[self.i]) {
            self.i += 1;
        }
    }

    fn token(&mut self) -> Result<Token<'a>, ParseError> {
        loop {
            let Some(c) = self.byte_at(self.i) else {
                return Ok(Token { tok: Tok::Eof, line: self.line, column: self.column });
            };
            if c == b'\n' {
                self.i += 1;
                self.line += 1;
                self.column = 1;
            } else if c.is_ascii_whitespace() {
                self.advance(1, 1);
            } else if !c.is_ascii() && self.char_at(self.i).is_some_and(char::is_whitespace) {
                let len = self.char_at(self.i).map_or(1, char::len_utf8);
                self.advance(len, 1);
            } else if c == b'/' && self.byte_at(self.i + 1) == Some(b'/') {
                // A comment runs to the end of the line; the newline is read as whitespace.
                self.skip_while(|b| b != b'\n');
            } else {
                break;
            }
        }
        let (line, column, start) = (self.line, self.column, self.i);
        let c = self.bytes[start];
        let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
        let tok = if c.is_ascii_alphabetic() || c == b'_' {
            self.skip_while(word);
            Tok::Ident(&self.text[start..self.i])
        } else if c == b'%' {
            self.i += 1;
            self.skip_while(|b| word(b) || b == b'.');
            if self.i == start + 1 {
                let found = self.char_at(self.i).map_or("end of input".to_owned(), describe_char);
                return Err(lex_error(line, column + 1, "a value name after '%'", found));
            }
            Tok::Value(&self.text[start + 1..self.i])
        } else if c.is_ascii_digit()
            || (c == b'-' && self.byte_at(start + 1).is_some_and(|n| n.is_ascii_digit() || n == b'i'))
        {
            self.i += 1;
            if c == b'-' && self.bytes[self.i] == b'i' {
                let word: String = self.text[self.i..].chars().take(3).collect();
                if word != "inf" {
                    return Err(lex_error(line, column, "a number", format!("'-{word}'")));
                }
                self.i += 3;
                Tok::Float(f64::NEG_INFINITY)
            } else {
                let mut is_float = false;
                while let Some(d) = self.byte_at(self.i) {
                    let exponent_sign = (d == b'-' || d == b'+') && matches!(self.bytes[self.i - 1], b'e' | b'E');
                    if d.is_ascii_digit() || exponent_sign {
                        self.i += 1;
                    } else if d == b'.' || d == b'e' || d == b'E' {
                        is_float = true;
                        self.i += 1;
                    } else {
                        break;
                    }
                }
                let literal = &self.text[start..self.i];
                if is_float {
                    let value = literal
                        .parse::<f64>()
                        .map_err(|_| lex_error(line, column, "a number", format!("'{literal}'")))?;
                    Tok::Float(value)
                } else {
                    let value = literal.parse::<i64>().map_err(|_| {
                        lex_error(line, column, "an integer that fits in 64 bits", format!("'{literal}'"))
                    })?;
                    Tok::Int(value)
                }
            }
        } else if c == b'"' {
            // A string argument: no escapes, so no quote, backslash or line break inside.
            self.i += 1;
            self.skip_while(|b| b != b'"' && b != b'\\' && b != b'\n');
            if self.byte_at(self.i) != Some(b'"') {
                let found = self.char_at(self.i).map_or("end of input".to_owned(), |c| format!("{c:?}"));
                return Err(lex_error(line, column, "a closing '\"' (strings have no escapes)", found));
            }
            self.i += 1;
            Tok::Str(&self.text[start + 1..self.i - 1])
        } else if b"(){}[],:=+@.".contains(&c) {
            self.i += 1;
            Tok::Punct(char::from(c))
        } else {
            let found = self.char_at(start).map_or_else(|| format!("'{}'", char::from(c)), describe_char);
            return Err(lex_error(line, column, "a token", found));
        };
        self.column += self.text[start..self.i].chars().count() as u32;
        Ok(Token { tok, line, column })
    }
}

struct Parser<'a> {
    lexer: Lexer<'a>,
    /// The next token (one token of lookahead).
    current: Token<'a>,
    /// The lexer's error where `current` is `Tok::Bad`.
    pending: Option<ParseError>,
    /// The values in scope, by name.
    names: HashMap<&'a str, ValueId>,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> &Token<'a> {
        &self.current
    }

    /// Takes the current token and reads the one after it. A token the lexer cannot read becomes
    /// `Tok::Bad` (which stays: nothing is read past it), reported when the parser reaches it.
    fn next(&mut self) -> Token<'a> {
        let token = self.current;
        if !matches!(token.tok, Tok::Eof | Tok::Bad) {
            self.current = match self.lexer.token() {
                Ok(next) => next,
                Err(error) => {
                    let bad = Token { tok: Tok::Bad, line: error.line, column: error.column };
                    self.pending = Some(error);
                    bad
                }
            };
        }
        token
    }

    fn error_at(&self, token: &Token<'a>, expected: &str) -> ParseError {
        if token.tok == Tok::Bad
            && let Some(error) = &self.pending
        {
            return error.clone();
        }
        ParseError {
            line: token.line,
            column: token.column,
            expected: expected.to_owned(),
            found: token.tok.to_string(),
        }
    }

    fn expect_punct(&mut self, c: char, expected: &str) -> Result<Token<'a>, ParseError> {
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

    fn ident(&mut self, expected: &str) -> Result<(&'a str, Token<'a>), ParseError> {
        let token = self.next();
        match token.tok {
            Tok::Ident(name) => Ok((name, token)),
            _ => Err(self.error_at(&token, expected)),
        }
    }

    fn keyword(&mut self, word: &str) -> Result<(), ParseError> {
        let token = self.next();
        match token.tok {
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
        let token = *self.peek();
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
        let Tok::Value(name) = token.tok else { return Err(self.error_at(&token, "an input name like '%x'")) };
        self.expect_punct(':', "':'")?;
        let meta = self.ty()?;
        let value = graph.add_input(name, meta);
        let node = graph.value(value).def;
        graph.node_mut(node).location = SourceLocation::new(token.line, token.column);
        if matches!(self.peek().tok, Tok::Ident("donated")) {
            self.next();
            if let NodeKind::Input { donated, .. } = &mut graph.node_mut(node).kind {
                *donated = true;
            }
        }
        self.define(graph, name, value, &token)
    }

    fn define(
        &mut self,
        graph: &mut Graph,
        name: &'a str,
        value: ValueId,
        token: &Token<'a>,
    ) -> Result<(), ParseError> {
        if self.names.insert(name, value).is_some() {
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
        let Tok::Value(name) = token.tok else { return Err(self.error_at(&token, "a value like '%x'")) };
        self.names.get(name).copied().ok_or_else(|| ParseError {
            line: token.line,
            column: token.column,
            expected: "a defined value".to_owned(),
            found: format!("undefined value '%{name}'"),
        })
    }

    fn statement(&mut self, graph: &mut Graph) -> Result<(), ParseError> {
        let start = *self.peek();
        let location = SourceLocation::new(start.line, start.column);
        if matches!(start.tok, Tok::Ident("output")) {
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
            let Tok::Value(name) = token.tok else {
                return Err(self.error_at(&token, "a result like '%0' or 'output'"));
            };
            results.push((name, token));
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
        let named = results.iter().map(|(name, _)| (*name).to_owned()).zip(types).collect();
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
            if matches!(self.peek().tok, Tok::Ident("writes")) {
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
            let (op, provider) = (graph.op_ref(op), graph.provider_ref(provider));
            return Ok(NodeKind::ImplCall { op, provider, writes, args: without_tokens(args) });
        }
        if let Some(op) = Builtin::from_name(name) {
            let args = self.args()?;
            return builtin(op, args, &token);
        }
        let mut overload = Overload::Default;
        if self.eat_punct('.') {
            self.keyword("maybe_inplace")?;
            overload = Overload::MaybeInplace;
        }
        let args = self.args()?;
        Ok(NodeKind::IrCall { op: graph.op_ref(name), overload, args: without_tokens(args) })
    }

    fn args(&mut self) -> Result<Vec<(Arg, Token<'a>)>, ParseError> {
        self.expect_punct('(', "'('")?;
        let mut args = Vec::new();
        if self.eat_punct(')') {
            return Ok(args);
        }
        loop {
            let token = *self.peek();
            let arg = match token.tok {
                Tok::Value(_) => Arg::Tensor(self.use_value()?),
                Tok::Ident(word) => {
                    self.next();
                    match word {
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
                    Arg::I64(v)
                }
                Tok::Float(v) => {
                    self.next();
                    Arg::F64(v)
                }
                Tok::Str(v) => {
                    self.next();
                    Arg::Str(v.to_owned())
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
                kind.to_owned()
            } else {
                self.expect_punct(':', "':' and a device index")?;
                format!("{kind}:{}", self.usize("a device index")?)
            };
            device =
                spelled.parse().map_err(|_| self.error_at(&kind_token, "a device (cpu, cuda:N, rocm:N, xpu:N)"))?;
        }
        let strides = strides.unwrap_or_else(|| ir_core::compact_strides(&shape));
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

/// The arguments alone, in a vector of their exact size: collecting in place would keep the larger
/// buffer of `(Arg, Token)` pairs alive for the graph's lifetime, several times the arguments' size.
fn without_tokens(args: Vec<(Arg, Token<'_>)>) -> Vec<Arg> {
    let mut exact = Vec::with_capacity(args.len());
    exact.extend(args.into_iter().map(|(arg, _)| arg));
    exact
}

/// Converts a built-in's positional arguments into its node kind, with the arity and the argument
/// kinds from the built-in table.
fn builtin(op: Builtin, args: Vec<(Arg, Token<'_>)>, at: &Token<'_>) -> Result<NodeKind, ParseError> {
    let params = op.def().params;
    if args.len() != params.len() {
        return Err(ParseError {
            line: at.line,
            column: at.column,
            expected: format!("{} argument(s) for {}", params.len(), op.signature()),
            found: format!("{} argument(s)", args.len()),
        });
    }
    let mut converted_args = Vec::with_capacity(args.len());
    for ((arg, token), param) in args.into_iter().zip(params) {
        let converted = match (arg, param) {
            (Arg::Tensor(v), BuiltinParam::Value) => Some(BuiltinArg::Value(v)),
            (Arg::I64(v), BuiltinParam::Index) => usize::try_from(v).ok().map(BuiltinArg::Index),
            (Arg::Ints(dims), BuiltinParam::Shape) => {
                dims.iter().map(|&d| usize::try_from(d).ok()).collect::<Option<Vec<_>>>().map(BuiltinArg::Shape)
            }
            (Arg::F64(v), BuiltinParam::Float) => Some(BuiltinArg::Float(v)),
            _ => None,
        };
        let Some(converted) = converted else {
            let what = match param {
                BuiltinParam::Value => "a value",
                BuiltinParam::Index => "a non-negative integer",
                BuiltinParam::Shape => "a list of non-negative integers",
                BuiltinParam::Float => "a float",
            };
            return Err(ParseError {
                line: token.line,
                column: token.column,
                expected: format!("{what} ({} takes {})", op.name(), op.signature()),
                found: token_text(&token),
            });
        };
        converted_args.push(converted);
    }
    Ok(NodeKind::Builtin { op, args: converted_args })
}

fn token_text(token: &Token<'_>) -> String {
    token.tok.to_string()
}
